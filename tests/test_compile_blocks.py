"""Blocks compiled one at a time, as torchtitan compiles them.

Three ways users write it, all of which work with torch's `fully_shard`: `torch.compile` each block
and then `fully_shard` the compiled module (torchtitan's `apply_compile` before `apply_fsdp`);
`fully_shard` first and then `block.compile()`; or blocks whose forward is a
`torch.compiler.nested_compile_region`, with the whole model compiled. Ours must give the same
numbers and parameter names, and compile the block's code once for all blocks. 2 gloo ranks,
`aot_eager`.
"""

import contextlib
import copy
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from _compile_helpers import collective_groups, dumped_graphs, train_bitwise_like_eager
from _harness import run_ranks
import fsdp_graph
from _models import Block, Llama, LlamaConfig, batch_for_step, global_mean, loss_fn, shard_llama, tiny_llama
from fsdp_graph import fully_shard


class _RegionBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


def _compile_blocks(model, shard, how: str, dump_dir=None):
    """(the model, what the training loop calls)"""
    whole_model = {  # the whole model compiled; our backend's options for each way
        "regions": {},
        "every_block_a_region": {"regions": "blocks"},  # no class changed: [Note: Every block a compile region]
        "block_scope": {"scope": "block"},  # each block's code one graph ([Note: Compile scope])
    }
    if how in whole_model:
        if how == "regions":
            for block in model.layers:
                block.__class__ = _RegionBlock
        options = whole_model[how]
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=dump_dir, **options) if shard is fully_shard else "aot_eager"
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
    dump_dir = tempfile.mkdtemp()
    ours = _train(_compile_blocks(copy.deepcopy(model), fully_shard, how, dump_dir), rank, world_size)
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
        # Ours: the whole step is one graph, the three blocks one region body traced as such
        # ([Note: Blocks as compile regions]); torch's fully_shard runs its hooks eagerly around
        # the regions (two graphs).
        assert (graphs, t_graphs) == (1, 2), (graphs, t_graphs)
        _check_one_region_body(dump_dir)
    elif how == "every_block_a_region":  # torch's side: fully_shard + torch.compile(model)
        assert graphs == 1, graphs
        _check_one_region_body(dump_dir, regions=2)  # the first block inline: [Note: Every block a compile region]
    elif how == "block_scope":
        _check_one_block_graph(dump_dir)
    else:
        assert graphs == t_graphs == 1, (graphs, t_graphs)  # one block graph, reused by all three blocks


def _check_one_region_body(dump_dir, regions=3) -> None:
    """The forward calls one region body `regions` times (the last blocks), with the gathers outside
    it; the backward gathers every region block again (they reshard after forward) rather than
    keeping their weights."""
    graphs = dumped_graphs(dump_dir)
    forward = (Path(dump_dir) / "frame_0_0.forward.txt").read_text()
    calls = re.findall(r"invoke_subgraph\(\w+, '(\w+)'", forward)
    assert len(calls) == regions and len(set(calls)) == 1, calls
    for block in ("layers.0", "layers.1", "layers.2")[3 - regions:]:
        assert collective_groups(graphs, "forward", "all_gather_into_tensor").count(block) == 1, block
        assert collective_groups(graphs, "backward", "all_gather_into_tensor").count(block) == 1, block


def _check_one_block_graph(dump_dir) -> None:
    """scope="block": the three blocks share one compiled graph, and no graph holds a collective
    (the eager runtime's hooks run them, as FSDP2 + torch.compile does)."""
    dynamo = [path.read_text() for path in sorted(Path(dump_dir).glob("*.dynamo.txt"))]
    assert sum("attention_modules_wq" in text for text in dynamo) == 1, len(dynamo)
    summary = json.loads((Path(dump_dir) / "summary.json").read_text())
    assert len(summary["graphs"]) == len(dynamo), summary["graphs"].keys()
    for graph_id, graphs in summary["graphs"].items():
        for kind in ("forward", "backward"):
            assert graphs[kind]["collectives"] == [], (graph_id, kind, graphs[kind]["collectives"])


@pytest.mark.parametrize("how", ["compile_then_shard", "shard_then_compile", "regions", "every_block_a_region", "block_scope"])
def test_blocks_compiled_one_by_one(how):
    run_ranks(_blocks_compiled, 2, how)


class _Logits(torch.nn.Module):
    """A transformers LlamaForCausalLM called as the training loop calls the tests' Llama."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, tokens):
        return self.hf(input_ids=tokens).logits


def _hf_llama(num_layers):
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    class RegionLayer(LlamaDecoderLayer):
        forward = torch.compiler.nested_compile_region(LlamaDecoderLayer.forward)

    config = HFConfig(vocab_size=64, hidden_size=128, intermediate_size=341, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    model = _Logits(LlamaForCausalLM(config))
    model.cfg = tiny_llama().cfg  # batch_for_step's tokens: vocabulary 64, sequences of 8
    return model, model.hf.model.layers, RegionLayer


def _shard_hf(model):
    for layer in model.hf.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _inductor_with_and_without_regions(rank, world_size):
    torch.manual_seed(0)
    model, layers, region_class = _hf_llama(num_layers=3)
    runs = []
    for regions in ("marked", "blocks", None):  # the layers' class marked; every block by the backend; none
        copied = copy.deepcopy(model)
        for layer in copied.hf.model.layers if regions == "marked" else []:
            layer.__class__ = region_class
        backend = fsdp_graph.backend(compiler="inductor", regions=regions or "marked")
        runs.append(_train((copied, torch.compile(_shard_hf(copied), backend=backend)), rank, world_size))
    return runs, _reference(copy.deepcopy(model), world_size)


@pytest.mark.slow  # Inductor compiles cold
def test_regions_compiled_by_inductor():
    pytest.importorskip("transformers")
    """A transformers Llama whose decoder layers are regions: Inductor compiles them as one body: the same numbers as the whole step without
    regions, and the unsharded model's within Inductor's own differences from eager. (With buffer
    reuse, torch 2.13's Inductor gets region gradients wrong on CPU,
    examples/repro/nested_region_inductor_grads.py: the backend turns it off for graphs with regions.)"""
    (marked, every_block, (p_losses, p_grads, p_params, _)), (r_losses, r_grads, _) = run_ranks(
        _inductor_with_and_without_regions, 2
    )
    losses, grads, params, graphs = marked
    assert graphs == every_block[3] == 1
    # regions="blocks" traces the same regions as the marked class: the same graph, the same numbers
    assert every_block[0] == losses, (every_block[0], losses)
    for step in range(3):
        for name, grad in grads[step].items():
            assert torch.equal(grad, every_block[1][step][name]), (step, name)
    torch.testing.assert_close(losses, p_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(losses, r_losses, rtol=1e-5, atol=0)
    for step in range(3):
        for name, grad in grads[step].items():
            torch.testing.assert_close(grad, p_grads[step][name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{step} {name}: {m}")
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, r_grads[0][name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    for name, param in params.items():
        torch.testing.assert_close(param, p_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _region_variant(rank, world_size, variant):
    """Regions and the eager runtime, both under `variant`'s settings: (losses, gradients) of each.
    "..., every block": the blocks' class unchanged, the backend makes them regions."""
    from fsdp_graph import MixedPrecisionPolicy

    variant, _, every_block = variant.partition(", ")

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, num_layers=3, num_heads=2, hidden_dim=56,
                              checkpoint_blocks=variant == "checkpoint"))
    kwargs = {
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "keep_unsharded": {"reshard_after_forward": False},
    }.get(variant, {})
    eager = shard_llama(copy.deepcopy(model), fully_shard, **kwargs)
    traced = copy.deepcopy(model)
    for block in [] if every_block else traced.layers:
        block.__class__ = _RegionBlock
    shard_llama(traced, fully_shard, **kwargs)
    dump_dir = tempfile.mkdtemp()
    budget = 1 << 34 if variant == "budget" else None  # room to keep every block unsharded
    backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=dump_dir, regions="blocks" if every_block else "marked",
                                 memory_budget_bytes=budget)
    compiled = torch.compile(traced, backend=backend)
    train_bitwise_like_eager(model, eager, traced, compiled, rank, world_size)
    regions = (Path(dump_dir) / "frame_0_0.forward.txt").read_text().count("= invoke_subgraph(")
    regathers = (Path(dump_dir) / "frame_0_0.backward.txt").read_text().count("= _c10d_functional.all_gather_into_tensor(")
    _check_params_like_torch(model, traced, variant, rank, world_size)
    return dict(traced._fsdp_state.ctx.fallbacks), counters["stats"]["unique_graphs"], regions, regathers


def _check_params_like_torch(model, trained, variant, rank, world_size, steps=2) -> None:
    """torch's fully_shard with `variant`'s settings, trained as `train_bitwise_like_eager` trains:
    `trained`'s parameters must be its."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision

    kwargs = {
        "bf16": {"mp_policy": TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "keep_unsharded": {"reshard_after_forward": False},
    }.get(variant, {})
    theirs = shard_llama(copy.deepcopy(model), torch_fully_shard, **kwargs)
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    for step in range(steps):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(theirs, theirs(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = dict(theirs.named_parameters())
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p.to_local(), expected[name].to_local(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("variant", ["bf16", "keep_unsharded", "checkpoint", "bf16, every block", "checkpoint, every block",
                                     "keep_unsharded, every block", "budget, every block"])
def test_regions_with_other_settings(variant):
    """Blocks as regions under mixed precision, reshard_after_forward=False, activation
    checkpointing around each block and a memory budget that keeps every block unsharded: one graph,
    no fallback, the eager runtime's numbers bit for bit (aot_eager), and the parameters torch's
    fully_shard trains with the same settings. Where the blocks stay unsharded (no resharding, or
    selective unsharding), the backward gathers no region block again."""
    fallbacks, graphs, regions, regathers = run_ranks(_region_variant, 2, variant)
    expected = 2 if variant.endswith("every block") else 3  # the first block inline: [Note: Every block a compile region]
    assert fallbacks == {} and graphs == 1 and regions == expected, (fallbacks, graphs, regions)
    if variant.startswith(("keep_unsharded", "budget")):
        assert regathers == 0, regathers
    else:
        assert regathers > 0, regathers  # the blocks reshard after forward


def _checkpointed_blocks(rank, world_size, policy):
    """torchtitan's layout: each block a `checkpoint_wrapper` (all of it recomputed, or selectively as
    torchtitan's default policy does: every other matmul saved), then sharded; the backend makes the
    blocks regions, the first inline. The eager runtime's numbers bit for bit (aot_eager), torch's
    fully_shard's parameters, and the backward's all-gathers in graph order."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def every_other_matmul():
        counts = {False: 0, True: 0}  # in forward, in the recompute

        def policy(ctx, op, *args, **kwargs):
            if op is not torch.ops.aten.mm.default:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, num_layers=3, num_heads=2, hidden_dim=56))
    options = {"context_fn": every_other_matmul} if policy == "selective" else {}
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, **options)
    eager = shard_llama(copy.deepcopy(model), fully_shard)
    traced = shard_llama(copy.deepcopy(model), fully_shard)
    dump_dir = tempfile.mkdtemp()
    # auto_bucket off: each block's gather on its own, so that their order shows
    backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=dump_dir, disabled_passes={"auto_bucket"})
    compiled = torch.compile(traced, backend=backend)
    train_bitwise_like_eager(model, eager, traced, compiled, rank, world_size)
    _check_params_like_torch(model, traced, "checkpoint", rank, world_size)
    regions = (Path(dump_dir) / "frame_0_0.forward.txt").read_text().count("= invoke_subgraph(")
    return dict(traced._fsdp_state.ctx.fallbacks), regions, collective_groups(dumped_graphs(dump_dir), "backward", "all_gather_into_tensor")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_checkpointed_block_traced_inline_before_regions_is_recomputed_for_its_own_gradient(policy):
    """[Note: A checkpointed block before a region] (passes/reshard.py): the first block, traced inline,
    is recomputed just before its own gradient, after the regions' (before, the second block's region
    read the first block's output, left to recompute: the backward gathered and recomputed the first
    block before the others, `layers.2, layers.0, layers.1`)."""
    fallbacks, regions, backward_gathers = run_ranks(_checkpointed_blocks, 2, policy)
    assert fallbacks == {} and regions == 2, (fallbacks, regions)
    assert backward_gathers == ["layers.2", "layers.1", "layers.0"], backward_gathers


def _block_scope_variant(rank, world_size, variant):
    """scope="block" against the eager runtime and torch's fully_shard under `variant`'s settings:
    (fallbacks, graphs compiled at 3 layers, at 5 layers)."""
    from fsdp_graph import MixedPrecisionPolicy

    kwargs = {
        "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        "keep_unsharded": {"reshard_after_forward": False},
    }.get(variant, {})
    graphs = []
    for num_layers in (3, 5):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab_size=64, dim=32, num_layers=num_layers, num_heads=2, hidden_dim=56,
                                  checkpoint_blocks=variant == "checkpoint"))
        eager = shard_llama(copy.deepcopy(model), fully_shard, **kwargs)
        traced = shard_llama(copy.deepcopy(model), fully_shard, **kwargs)
        if variant == "options":  # the registered backend, configured through torch.compile's options
            compiled = torch.compile(traced, backend="fsdp_graph", options={"compiler": "aot_eager", "scope": "block"})
        else:
            compiled = torch.compile(traced, backend=fsdp_graph.backend(compiler="aot_eager", scope="block"))
        train_bitwise_like_eager(model, eager, traced, compiled, rank, world_size)
        _check_params_like_torch(model, traced, variant, rank, world_size)
        graphs.append(counters["stats"]["unique_graphs"])
    return dict(traced._fsdp_state.ctx.fallbacks), graphs


@pytest.mark.parametrize("variant", ["options", "bf16", "keep_unsharded", "checkpoint"])
def test_block_scope(variant):
    """torch.compile(model, backend=fsdp_graph.backend(scope="block")): every group on the eager
    runtime's hooks (not reported as fallbacks), the blocks' code compiled once: as many graphs at 5
    layers as at 3; the eager runtime's numbers bit for bit (aot_eager; the whole-step graph gives
    them too, tests/test_compile_parity.py), and the parameters torch's fully_shard trains."""
    fallbacks, graphs = run_ranks(_block_scope_variant, 2, variant)
    assert fallbacks == {} and graphs[0] == graphs[1], (fallbacks, graphs)


def _plain_compile(rank, world_size):
    """Ours and torch's fully_shard under torch.compile with a backend not fsdp_graph's (aot_eager,
    noting which ops each graph holds): (graph ops, collectives per step, losses) of each."""
    from collections import Counter

    from torch._dynamo.backends.registry import lookup_backend

    torch.manual_seed(0)
    model = tiny_llama(num_layers=3)
    results = []
    for shard in (fully_shard, torch_fully_shard):
        torch._dynamo.reset()
        ops: set[str] = set()

        graphs = []

        def noting_ops(gm, example_inputs):
            ops.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            graphs.append(sorted(str(node.target) for node in gm.graph.nodes if node.op == "call_function"))
            return lookup_backend("aot_eager")(gm, example_inputs)

        sharded = shard_llama(copy.deepcopy(model), shard)
        run = torch.compile(sharded, backend=noting_ops)
        optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        losses, counts = [], []
        for step in range(2):
            _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = loss_fn(sharded, run(x), y)
                loss.backward()
            counts.append(Counter(e.name for e in prof.events() if e.name.startswith("gloo:")))
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        results.append((sorted(ops), counts, losses, sorted(graphs)))
    return results


def test_plain_torch_compile_keeps_fsdp2s_structure():
    """`torch.compile(model)` with a backend not ours has no pass that reshards after forward: a step
    traced for it kept every gathered weight for backward. So, as under torch's fully_shard, no graph
    holds a collective and the groups run on the eager hooks: every block gathered again in backward
    (the same collectives per step as torch's), the same losses."""
    (ops, counts, losses, graphs), (t_ops, t_counts, t_losses, t_graphs) = run_ranks(_plain_compile, 2)
    assert not [op for op in ops if "c10d" in op or "fsdp_graph" in op or "autograd_function_apply" in op], ops
    assert counts == t_counts and counts[0]["gloo:all_gather"] == 7, (counts, t_counts)  # root once, 3 blocks twice
    torch.testing.assert_close(losses, t_losses, rtol=1e-6, atol=0)
    # The same graphs as under torch's fully_shard: the root's loop over its blocks breaks, so Dynamo
    # runs the root's forward itself, and its embedding and output layer run eagerly, not as
    # graphs of their own ([Note: Owner checks in block scope] in traced/state.py).
    assert graphs == t_graphs, (len(graphs), len(t_graphs))


class _ScaledBlock(torch.nn.Module):
    """A block whose forward reads a Python number of its own: blocks of one kind, traced apart."""

    def __init__(self, dim: int, scale: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.scale


def _every_block_traced_once(rank, world_size):
    """regions="blocks" on 6 blocks of one kind, then on 20 blocks that differ by a number their
    forward reads, two blocks in a row alike: (region calls Dynamo traced, region calls it reused,
    times torch built a region's schema, loss, reference loss) each."""
    from _models import MLPStack, check_grads_match
    from torch._dynamo.utils import compilation_time_metrics
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    gen_schema, schemas = InvokeSubgraphHOP.gen_schema, []

    def counted(*args, **kwargs):  # torch's own method, counted
        schemas.append(1)
        return gen_schema(*args, **kwargs)

    results = []
    for scaled in (False, True):
        torch._dynamo.reset()
        compilation_time_metrics.clear()
        schemas.clear()
        torch.manual_seed(0)
        model = MLPStack(dim=16, hidden=24, num_blocks=6)
        if scaled:  # ten scales, each in two blocks in a row
            model.blocks = torch.nn.ModuleList(_ScaledBlock(16, 0.5 + (i // 2) / 10) for i in range(20))
        reference = copy.deepcopy(model)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", regions="blocks"))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        InvokeSubgraphHOP.gen_schema = counted
        try:
            loss = compiled(x.chunk(world_size)[rank]).square().mean()
        finally:
            InvokeSubgraphHOP.gen_schema = gen_schema
        loss.backward()
        ref_loss = reference(x).square().mean()
        ref_loss.backward()
        check_grads_match(model, reference)
        traced = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
        reused = len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", []))
        results.append((traced, reused, len(schemas), global_mean(loss), ref_loss.item()))
    return results


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_every_block_region_traced_once_by_dynamo():
    """With regions="blocks" Dynamo traces a block kind's region once and reuses it for the blocks
    after it ([Note: Blocks as compile regions] in traced/regions.py): of 6 blocks, the first goes
    inline, the second is traced as a region, four reuse it. Blocks whose forward reads a number of
    their own are kinds apart ([Note: Numbers a block's trace guarded on]): of two alike, the first
    goes inline and the second is traced as a region, which reuses none of the others' (ten region
    bodies, more than torch's default of 8 entries a region keeps). AOTAutograd builds the one
    body's schema a few times, not at every call. Gradients as the unsharded model's on the global
    batch."""
    (traced, reused, schemas, loss, ref), (s_traced, s_reused, s_schemas, s_loss, s_ref) = run_ranks(_every_block_traced_once, 2)
    assert (traced, reused) == (1, 4), (traced, reused)
    assert (s_traced, s_reused) == (10, 0), (s_traced, s_reused)
    # AOTAutograd's schema of the one region body: built once per pass over the step, not once per
    # call ([Note: A region's schema once per body] in fsdp_graph/compile/region_schema.py)
    assert 1 <= schemas <= 3, schemas
    assert loss == pytest.approx(ref, rel=1e-5) and s_loss == pytest.approx(s_ref, rel=1e-5)


class _VariedBlock(torch.nn.Module):
    """Blocks of one class that regions="blocks" must not trip over: `variant` says how they
    differ from a plain block (see `test_every_block_region_where_blocks_differ`)."""

    def __init__(self, i: int, variant: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        if variant == "nested":
            self.inner = torch.nn.Linear(16, 16)  # sharded as a group of its own, inside the block's
        self.variant = variant
        self.layer_type = "global" if i % 2 else "local"  # as Gemma's sliding and global layers
        self.index = i
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        if self.variant == "nested":
            x = self.inner(x)
        if self.variant == "flag" and self.layer_type == "global":
            torch._dynamo.graph_break()  # only the odd blocks break the graph
        if self.variant == "number" and self.index == 2:
            torch._dynamo.graph_break()  # only the third block, the second of its kind, breaks the graph
        if self.variant == "buffer":
            self.calls.add_(1)  # a buffer changed in place, as BatchNorm's statistics are
        if self.variant == "input_in_place":
            x.mul_(0.5)  # the block's input changed in place
        if self.variant == "view_of_input":
            return x + torch.tanh(self.lin(x)) * mask, mask.view(mask.shape)  # the mask, as a view of it
        return x + torch.tanh(self.lin(x)) * mask, mask  # the mask passed through, as it came


class _MatmulFlops(TorchDispatchMode):
    """A user's TorchDispatchMode: counts the FLOPs of the matrix products it sees, and handles no
    higher-order operator (a compile region's call would raise)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a, b = args[-2:]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


class _VariedStack(torch.nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(_VariedBlock(i, variant) for i in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, mask = self.inp(x), (x[:, :1] > 0).to(x.dtype)
        for block in self.blocks:
            x, mask = block(x, mask)
        return x.square().mean()


def _blocks_that_differ(rank, world_size, variant):
    """Two AdamW steps of `_VariedStack(variant)` under regions="blocks", and of the unsharded
    model on the global batch: (losses, reference losses, gradients match, buffer counts, reference
    counts, region calls Dynamo traced or reused)."""
    from _models import check_grads_match
    from torch._dynamo.utils import compilation_time_metrics

    torch._dynamo.reset()
    compilation_time_metrics.clear()
    torch.manual_seed(0)
    model = _VariedStack(variant)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        if variant == "nested":
            fully_shard(block.inner)
        fully_shard(block)
    fully_shard(model)
    compiled = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", regions="blocks"))
    optimizer, ref_optimizer = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    losses, ref_losses, flops = [], [], []
    for step in range(2):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        outputs = []
        for run, inputs in ((compiled, x.chunk(world_size)[rank]), (reference, x)):
            outputs.append(run(inputs))
            # a user's TorchDispatchMode around the backward of a compiled step, as a FLOP count is
            with _MatmulFlops() if variant == "dispatch_mode" and step else contextlib.nullcontext() as counter:
                outputs[-1].backward()
            flops.append(counter.flops if counter is not None else 0)
        loss, ref_loss = outputs
        check_grads_match(model, reference)
        losses.append(global_mean(loss))
        ref_losses.append(ref_loss.item())
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    regions = sum(len(compilation_time_metrics.get(f"invoke_subgraph_{what}", [])) for what in ("trace", "reuse_stamp_out"))
    counts = [int(b.calls) for b in model.blocks], [int(b.calls) for b in reference.blocks]
    return losses, ref_losses, *counts, regions, flops


@pytest.mark.parametrize("variant", ["flag", "number", "pass_through", "view_of_input", "buffer", "input_in_place",
                                     "dispatch_mode", "nested"])
def test_every_block_region_where_blocks_differ(variant):
    """regions="blocks" trains where the inline step does ([Note: Every block a compile region]):
    blocks whose string attribute sends every other one into a graph break (each kind's first
    block goes inline, so the break is met outside a region), blocks whose number sends one into a
    graph break (its value joins the kind, as its kind's first block's trace guarded on it: [Note:
    Numbers a block's trace guarded on]; torch raised inside the region), blocks that hand an input back, as
    it is or as a view of it (copied at the region's end: torch raised on the view), and blocks that change a buffer or their input in place, which
    AOTAutograd refuses in a region (the graph compiles again with its regions inline). Losses and
    gradients as the unsharded model's on the global batch; buffers as its. And a step under a user's
    TorchDispatchMode (a FLOP count of the backward), which refuses a region's call: the regions are
    inlined once our passes scheduled the step, so the mode counts half the unsharded model's
    backward FLOPs on the global batch. And blocks with a sharded submodule (a group inside the
    block's), which stay inline."""
    losses, ref_losses, counts, ref_counts, regions, flops = run_ranks(_blocks_that_differ, 2, variant)
    assert losses == pytest.approx(ref_losses, rel=1e-5), (losses, ref_losses)
    assert counts == ref_counts, (counts, ref_counts)
    if variant in ("pass_through", "view_of_input"):
        # blocks 2 and 3 (the first local and global ones go inline): the mask passed through is no obstacle
        assert regions == 2, regions
    if variant == "number":
        assert regions == 0, regions  # every index read and different: every block inline
    if variant == "nested":  # the blocks stay inline; their inner groups' modules are blocks of one kind
        assert regions == 3, regions
    if variant == "dispatch_mode":
        assert regions == 2 and flops[2] > 0 and flops[2] * 2 == flops[3], (regions, flops)
