"""FSDP2 features under `backend="fsdp_graph"` (aot_eager): each trains like an unsharded model and
like the eager runtime (or, where noted, like the unsharded model alone), on 2 gloo ranks. The eager
halves of these features are in test_features.py, test_runtime_wrapping.py, test_runtime_controls.py
and test_runtime_fsdp2_parity.py."""

import copy
import tempfile
import unittest.mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_graph
from _compile_helpers import (
    assert_every_llama_group_fell_back, collective_groups, dumped_graphs, train_bitwise_like_eager, train_compiled_and_compare,
)
from _harness import run_ranks
from _models import (
    MLPStack, batch_for_step, check_grads_match, check_params_match, loss_fn, paired_llama, shard_blocks_then_root,
    shard_llama, tiny_llama,
)
from fsdp_graph import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from test_features import CheckpointedLlama, _deterministic_init, _wrapped_blocks, clip_like_unsharded, meta_sharded_mlp


def _model(name):
    torch.manual_seed(0)
    if name == "frozen":
        model = MLPStack()
        for block in model.blocks:
            block.up.weight.requires_grad_(False)
        model.inp.requires_grad_(False)
        return model
    model = tiny_llama()
    if name in ("tied_list", "tied_root"):
        model.output.weight = model.tok_embeddings.weight
    elif name == "meta_init":
        model = MLPStack()
        _deterministic_init(model)
    return model


def _shard(name):
    def shard(m):
        if name == "frozen" or name == "meta_init":
            return shard_blocks_then_root(m)
        if name == "tied_list":
            for layer in m.layers:
                fully_shard(layer)
            fully_shard([m.tok_embeddings, m.output])
            return fully_shard(m)
        if name == "offload":
            return shard_llama(m, fully_shard, offload_policy=CPUOffloadPolicy(pin_memory=False))
        return shard_llama(m, fully_shard)
    return shard


def _feature(rank, world_size, name):
    shard = meta_sharded_mlp if name == "meta_init" else _shard(name)
    result = train_compiled_and_compare(
        _model(name), shard, fsdp_graph.backend(compiler="aot_eager"), rank, world_size
    )
    return result["fallbacks"]


@pytest.mark.parametrize("name", ["frozen", "tied_list", "tied_root", "offload", "meta_init"])
def test_feature_compiled_matches_eager_and_unsharded(name):
    fallbacks = run_ranks(_feature, 2, name)
    assert fallbacks == {}, fallbacks  # every group traced into the graph


def _mixed_precision(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    eager = shard_llama(copy.deepcopy(model), fully_shard, mp_policy=mp)
    traced = shard_llama(copy.deepcopy(model), fully_shard, mp_policy=mp)
    compiled = torch.compile(traced, backend=fsdp_graph.backend(compiler="aot_eager"))
    # The same casts in the same order as the eager runtime (which matches torch's FSDP2 with the
    # same policy, test_runtime_fsdp2_parity): bit for bit; fp32 parameters and gradients.
    train_bitwise_like_eager(model, eager, traced, compiled, rank, world_size)
    assert all(p.dtype == torch.float32 for p in traced.parameters())
    return dict(traced._fsdp_state.ctx.fallbacks)


def test_bf16_mixed_precision_compiled_equals_eager():
    assert run_ranks(_mixed_precision, 2) == {}


def _activation_checkpointing(rank, world_size, how):
    torch.manual_seed(0)
    model = tiny_llama()
    if how == "checkpoint":
        model.__class__ = CheckpointedLlama  # checkpoint(layer, ...) around each sharded block
    else:
        model = _wrapped_blocks(model)  # checkpoint_wrapper, then fully_shard on the wrapper
    with tempfile.TemporaryDirectory() as tmp:
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=tmp)
        result = train_compiled_and_compare(model, lambda m: shard_llama(m, fully_shard), backend, rank, world_size)
        graphs = dumped_graphs(tmp)

    def ops(kind, op):
        return collective_groups(graphs, kind, op)

    return {
        "fallbacks": result["fallbacks"],
        "forward_gathers": ops("forward", "all_gather_into_tensor"),
        "backward_gathers": ops("backward", "all_gather_into_tensor"),
        "backward_reductions": ops("backward", "reduce_scatter_tensor"),
        "saved_unsharded": sorted({s["group"] for s in graphs["forward"]["saved_unsharded"]}),
    }


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_activation_checkpointing_compiled(how):
    """Parity with the unsharded model and bitwise with the eager runtime; one graph; and the
    recomputed blocks gather once each in backward, exactly as without checkpointing."""
    got = run_ranks(_activation_checkpointing, 2, how)
    assert got == {
        "fallbacks": {},
        "forward_gathers": ["<root>", "layers.0", "layers.1"],
        "backward_gathers": ["layers.1", "layers.0"],
        "backward_reductions": ["layers.1", "layers.0", "<root>"],
        "saved_unsharded": ["<root>"],  # the root keeps its parameters (reshard_after_forward=False)
    }, got


def test_grad_scaler_compiled():
    from test_features import grad_scaler_run

    scales = run_ranks(grad_scaler_run, 2, True)
    assert [s for s, _ in scales] == [s for _, s in scales] == [2.0**16, 2.0**15, 2.0**15, 2.0**16], scales


def _compile(model):
    return torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))


def _ignored_params(rank, world_size):
    torch.manual_seed(0)
    model = MLPStack()
    reference, local_reference, sharded = (copy.deepcopy(model) for _ in range(3))
    for block in sharded.blocks:
        fully_shard(block)
    fully_shard(sharded, ignored_params={sharded.head.weight})
    compiled = _compile(sharded)
    x, y, lx, ly = batch_for_step(model, 0, 8, rank, world_size)
    loss_fn(reference, reference(x), y).backward()
    loss_fn(local_reference, local_reference(lx), ly).backward()  # what this rank alone computes
    loss_fn(sharded, compiled(lx), ly).backward()
    ignored = sharded.head.weight
    assert isinstance(sharded.head.bias, DTensor)
    assert not isinstance(ignored, DTensor) and not isinstance(ignored.grad, DTensor)
    torch.testing.assert_close(ignored.detach(), model.head.weight.detach(), rtol=0, atol=0)  # whole
    # Not reduced: this rank's own gradient, not the global one (the ranks' slices differ).
    torch.testing.assert_close(ignored.grad, local_reference.head.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ignored.grad, reference.head.weight.grad, rtol=1e-3, atol=0)
    ignored.grad = reference.head.weight.grad = None  # compared above; the others are reduced
    assert check_grads_match(sharded, reference) == len(list(model.parameters())) - 1
    return dict(sharded._fsdp_state.ctx.fallbacks)


def test_ignored_params_compiled_stay_local():
    assert run_ranks(_ignored_params, 2) == {}  # traced, not run on the eager hooks


def _clip_grad_norm(rank, world_size):
    model, reference, sharded = paired_llama()
    compiled = _compile(sharded)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, sharded)]
    for step in range(2):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(reference, reference(x), y).backward()
        loss_fn(sharded, compiled(lx), ly).backward()
        clip_like_unsharded(reference, sharded)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    check_params_match(sharded, reference, atol=1e-5)
    return dict(sharded._fsdp_state.ctx.fallbacks)


def test_clip_grad_norm_after_compiled_backward():
    assert run_ranks(_clip_grad_norm, 2) == {}


class _Shards:
    """The model's parameters as the optimizer holds them (the DTensor shards), for
    `check_grads_match`: a group left gathered by `set_reshard_after_backward(False)` registers its
    unsharded parameters on the modules until the optimizer step."""

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.named_parameters())

    def named_parameters(self):
        return iter(self._params)


def _set_controls(sharded, control, micro, num_micro):
    last = micro == num_micro - 1
    if control == "is_last_backward":
        sharded.set_is_last_backward(last)  # False: the backward does not wait for its reduce-scatters
    else:
        sharded.set_reshard_after_backward(False)
        sharded.set_requires_gradient_sync(last)  # off: groups run on the eager hooks


def _controls(rank, world_size, control):
    """Steps of 3, 1, 2 and 1 micro-batches; the accumulating ones under `control`, the others plain
    compiled steps. Gradients and parameters against the unsharded model trained the same way
    (same AdamW), and how many reduce-scatters the eager hooks issued per step."""
    model, reference, sharded = paired_llama()
    shards = _Shards(sharded)
    compiled = _compile(sharded)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    eager_reduce_scatters = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        eager_reduce_scatters[-1] += 1
        return reduce_scatter(*args, **kwargs)

    for step, num_micro in enumerate([3, 1, 2, 1]):
        eager_reduce_scatters.append(0)
        for micro in range(num_micro):
            x, y, lx, ly = batch_for_step(model, 10 * step + micro, 8, rank, world_size)
            (loss_fn(reference, reference(x), y) / num_micro).backward()
            if num_micro > 1:
                _set_controls(sharded, control, micro, num_micro)
            with unittest.mock.patch.object(dist, "reduce_scatter_single", counted):
                (loss_fn(sharded, compiled(lx), ly) / num_micro).backward()
        check_grads_match(shards, reference)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        check_params_match(sharded, reference, atol=1e-5)  # the step resharded: these are the shards
    return eager_reduce_scatters, dict(sharded._fsdp_state.ctx.fallbacks)


def test_is_last_backward_compiled():
    eager_reduce_scatters, fallbacks = run_ranks(_controls, 2, "is_last_backward")
    assert eager_reduce_scatters == [0, 0, 0, 0] and fallbacks == {}, (eager_reduce_scatters, fallbacks)


def test_accumulation_without_sync_or_reshard_compiled():
    """Accumulating steps run on the eager hooks (one reduce-scatter per group, in the synced
    micro-batch), and leave the groups gathered; the optimizer step reshards them, and the plain
    steps after them run the graph on the new shards."""
    eager_reduce_scatters, fallbacks = run_ranks(_controls, 2, "reshard_after_backward")
    assert eager_reduce_scatters == [3, 0, 3, 0], eager_reduce_scatters
    assert_every_llama_group_fell_back(fallbacks, "gradient sync is off")
