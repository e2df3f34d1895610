"""Blocks compiled one at a time, as torchtitan compiles them.

Three ways users write it, all of which work with torch's `fully_shard`: `torch.compile` each block
and then `fully_shard` the compiled module (torchtitan's `apply_compile` before `apply_fsdp`);
`fully_shard` first and then `block.compile()`; or blocks whose forward is a
`torch.compiler.nested_compile_region`, with the whole model compiled. Ours must give the same
numbers and parameter names, and compile the block's code once for all blocks. 2 gloo ranks,
`aot_eager`.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from _harness import run_ranks
import fsdp_graph
from _models import Block, batch_for_step, global_mean, loss_fn, shard_llama, tiny_llama
from fsdp_graph import fully_shard


class _RegionBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


def _compile_blocks(model, shard, how: str):
    """(the model, what the training loop calls)"""
    if how == "regions":
        for block in model.layers:
            block.__class__ = _RegionBlock
        backend = fsdp_graph.backend(compiler="aot_eager") if shard is fully_shard else "aot_eager"
        return model, torch.compile(shard_llama(model, shard), backend=backend)
    if how == "compile_then_shard":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend="aot_eager")
    shard_llama(model, shard)
    if how == "shard_then_compile":
        for block in model.layers:
            block.compile(backend="aot_eager")
    return model, model


def _train(model_and_run, rank, world_size):
    """Three AdamW steps on this rank's half of each global batch: (losses, gradients, parameters, graphs)."""
    model, run = model_and_run
    torch._dynamo.reset()
    counters.clear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(3):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        loss = loss_fn(model, run(x), y)
        loss.backward()
        losses.append(global_mean(loss))
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    return losses, grads, params, counters["stats"]["unique_graphs"]


def _reference(model, world_size):
    """The unsharded model on the global batches: (losses, gradients, parameters)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(3):
        x, y, _, _ = batch_for_step(model, step, 8, 0, world_size)
        loss = loss_fn(model, model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, {name: p.detach() for name, p in model.named_parameters()}


def _blocks_compiled(rank, world_size, how):
    torch.manual_seed(0)
    model = tiny_llama(num_layers=3)
    ours = _train(_compile_blocks(copy.deepcopy(model), fully_shard, how), rank, world_size)
    theirs = _train(_compile_blocks(copy.deepcopy(model), torch_fully_shard, how), rank, world_size)
    ref_losses, ref_grads, ref_params = _reference(copy.deepcopy(model), world_size)

    (losses, grads, params, graphs), (t_losses, t_grads, t_params, t_graphs) = ours, theirs
    assert list(params) == list(t_params), "parameter names differ from torch's fully_shard"
    torch.testing.assert_close(losses, t_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    unwrapped = {name: name.replace("._orig_mod", "") for name in params}
    for step in range(3):
        for name, grad in grads[step].items():
            torch.testing.assert_close(grad, t_grads[step][name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{step} {name}: {m}")
            torch.testing.assert_close(grad, ref_grads[step][unwrapped[name]], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{step} {name}: {m}")
    for name, param in params.items():
        torch.testing.assert_close(param, t_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(param, ref_params[unwrapped[name]], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    if how == "regions":
        # One graph for the three blocks' regions. Our root's call runs on the eager hooks, so its
        # embedding, norm and output layer are compiled one by one (torch's: two graphs in all).
        assert (graphs, t_graphs) == (4, 2), (graphs, t_graphs)
    else:
        assert graphs == t_graphs == 1, (graphs, t_graphs)  # one block graph, reused by all three blocks


@pytest.mark.parametrize("how", ["compile_then_shard", "shard_then_compile", "regions"])
def test_blocks_compiled_one_by_one(how):
    run_ranks(_blocks_compiled, 2, how)
