"""FSDP1 conveniences above fully_shard: wrap policies, strategies, rank-0 loading, full state dicts,
summon_full_params, no_sync and comm hooks, each against an unsharded reference."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from _compile_helpers import assert_every_llama_group_fell_back, train_compiled_and_compare
from _harness import run_ranks
from _models import (
    backward_on_both, paired_llama,
    Block, MLPStack, batch_for_step, check_grads_match, comm_counts, loss_fn, shard_llama, tiny_llama,
    train_and_compare,
)
from _models import MLPBlock  # noqa: F401  (a class for ModuleWrapPolicy)
from fsdp_graph import FSDPModule, fully_shard
from fsdp_graph.fsdp1.comm_hooks import bf16_compress_hook, register_comm_hook
from fsdp_graph.fsdp1.full_params import (
    full_optim_state_dict, full_state_dict, load_full_state_dict, no_sync, summon_full_params,
)
from fsdp_graph.fsdp1.wrap import (
    CustomWrapPolicy, ModuleWrapPolicy, ShardingStrategy, SizeBasedWrapPolicy, fully_shard_with_strategy,
    strategy_kwargs, wrap,
)


def _groups(model):
    return sorted({m._fsdp_state.name for m in model.modules() if isinstance(m, FSDPModule)})


def _wrap_policies(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    plans = {}

    def by_class(m):
        m, plans["class"] = wrap(m, ModuleWrapPolicy({Block}))
        return m

    train_and_compare(model, by_class, rank, world_size, steps=2)
    block_params = sum(p.numel() for p in model.layers[0].parameters())
    assert [g.fqn for g in plans["class"].groups] == ["layers.0", "layers.1", ""]
    assert plans["class"].groups[0].num_params == block_params
    assert sum(g.num_params for g in plans["class"].groups) == sum(p.numel() for p in model.parameters())

    # By size: an MLPStack block has 13*5+5+5*13+13 = 148 parameters, `inp` 182, `head` 14.
    mlp = MLPStack()
    wrapped, plan = wrap(copy.deepcopy(mlp), SizeBasedWrapPolicy(min_num_params=148))
    assert [g.fqn for g in plan.groups] == ["inp", "blocks.0", "blocks.1", "blocks.2", ""]
    assert plan.groups[-1].num_params == 14
    assert _groups(wrapped) == ["<root>", "blocks.0", "blocks.1", "blocks.2", "inp"]

    # A custom callable with FSDP1's meaning: never look inside blocks, wrap each block.
    calls = []

    def custom(module, recurse, nonwrapped_numel):
        calls.append((type(module).__name__, recurse))
        return not isinstance(module, MLPBlock) if recurse else isinstance(module, nn.ModuleList)

    _, plan = wrap(copy.deepcopy(mlp), CustomWrapPolicy(custom))
    assert [g.fqn for g in plan.groups] == [""]  # ModuleList has no forward: never wrapped
    assert ("MLPBlock", True) in calls and calls.count(("Linear", True)) == 2  # inp, head: blocks not entered
    torch.manual_seed(0)
    train_and_compare(mlp, lambda m: wrap(m, lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, MLPBlock))[0],
                      rank, world_size, steps=2)
    return str(plans["class"])


def test_wrap_policies_build_groups_and_train_like_unsharded():
    text = run_ranks(_wrap_policies, 2)
    assert "layers.0" in text and "3 groups" in text


def _strategy(rank, world_size, strategy):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, world_size // 2)) if "HYBRID" in strategy else None
    model = tiny_llama()

    def shard(m):
        for layer in m.layers:
            fully_shard_with_strategy(layer, strategy, mesh)
        fully_shard_with_strategy(m, strategy, mesh)
        return m

    train_and_compare(model, shard, rank, world_size, steps=2)
    sharded = shard(copy.deepcopy(model))
    local = sharded.layers[0].attention.wq.weight.to_local()
    _, _, x, y = batch_for_step(model, 0, 8, rank, world_size)
    with CommDebugMode() as mode:
        loss_fn(sharded, sharded(x), y).backward()
    return tuple(local.shape), comm_counts(mode)


@pytest.mark.parametrize("strategy,world_size", [
    ("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 2), ("HYBRID_SHARD", 4), ("_HYBRID_SHARD_ZERO2", 4),
])
def test_sharding_strategies(strategy, world_size):
    local_shape, counts = run_ranks(_strategy, world_size, strategy)
    dim = 32
    shard_size = {"NO_SHARD": 1, "HYBRID_SHARD": 2, "_HYBRID_SHARD_ZERO2": 2}.get(strategy, world_size)
    assert local_shape == (dim // shard_size, dim)
    regather = {"FULL_SHARD": 3, "HYBRID_SHARD": 3}.get(strategy, 0)
    # One rank per shard group gathers nothing, as FSDP2 ([Note: One rank issues no collectives]).
    assert counts.get("_allgather_base_", 0) == (0 if shard_size == 1 else 3 + regather)
    if strategy in ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        assert counts["allreduce_"] == 3  # across replicas


def test_strategy_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown sharding strategy 'FULL'"):
        strategy_kwargs("FULL")
    with pytest.raises(ValueError, match="needs a 2-D mesh"):
        strategy_kwargs(ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(TypeError, match="ShardingStrategy or its name"):
        strategy_kwargs(3)


def _rank0_loading(rank, world_size):
    torch.manual_seed(0)
    reference = tiny_llama()
    with torch.device("meta"):
        model = tiny_llama()
    shard_llama(model, fully_shard)
    model.to_empty(device="cpu")
    state = reference.state_dict() if rank == 0 else None
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        load_full_state_dict(model, state)
    peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.equal(full, reference.state_dict()[key]), key
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    largest_slot = max(p.to_local().numel() * 4 for p in model.parameters())
    full_bytes = sum(p.numel() * 4 for p in reference.parameters())
    if rank != 0:
        # Shards, buffers and one parameter's slot twice (our receive buffer and the scatter's
        # own staging copy): the full model never arrives here.
        assert peak <= shard_bytes + buffer_bytes + 2 * largest_slot, (peak, shard_bytes, buffer_bytes, largest_slot)
        assert peak < full_bytes
    return peak, full_bytes


def test_rank0_loading_scatters_shards():
    run_ranks(_rank0_loading, 2)


def _full_state(rank, world_size):
    model, reference, sharded = paired_llama()
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(2):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(reference, reference(x), y).backward()
        loss_fn(sharded, sharded(lx), ly).backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    full = full_state_dict(sharded, rank0_only=True, offload_to_cpu=True)
    if rank == 0:
        assert full.keys() == reference.state_dict().keys()
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-5)
        plain = tiny_llama()
        plain.load_state_dict(full)  # round-trips through an unsharded model
    else:
        assert full == {}
    optim_full = full_optim_state_dict(sharded, opt)
    ref_optim = get_optimizer_state_dict(reference, ref_opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        for fqn, per_param in ref_optim["state"].items():
            for name, value in per_param.items():
                torch.testing.assert_close(optim_full["state"][fqn][name], value, rtol=1e-4, atol=1e-6)
    # ... and back into a sharded model
    torch.manual_seed(5)
    again = shard_llama(tiny_llama(), fully_shard)
    load_full_state_dict(again, full if rank == 0 else None)
    for k, v in again.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), reference.state_dict()[k], rtol=1e-5, atol=1e-5)


def test_full_state_dicts_round_trip():
    run_ranks(_full_state, 2)


def _summon(rank, world_size):
    model, reference, sharded = paired_llama()
    lx, ly = backward_on_both(reference, sharded, 0, rank, world_size)
    with summon_full_params(sharded, writeback=True, with_grads=True):
        for name, p in sharded.named_parameters():
            assert not isinstance(p, DTensor), name
            assert torch.equal(p, reference.get_parameter(name)), name
            torch.testing.assert_close(p.grad, reference.get_parameter(name).grad, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            sharded.layers[0].attention.wq.weight.mul_(2)  # an edit, written back on exit
    assert isinstance(sharded.layers[0].attention.wq.weight, DTensor)
    edited = sharded.layers[0].attention.wq.weight.full_tensor()
    assert torch.equal(edited, reference.layers[0].attention.wq.weight.detach() * 2)
    with summon_full_params(sharded, writeback=False, rank0_only=True):
        is_full = not isinstance(sharded.output.weight, DTensor)
    assert is_full == (rank == 0)

    def summon_in_forward(module, args):
        with summon_full_params(sharded):
            pass

    sharded.layers[1].register_forward_pre_hook(summon_in_forward)
    with pytest.raises(ValueError, match="cannot run inside forward or backward"):
        sharded(lx)
    with pytest.raises(ValueError, match="rank0_only=True, writeback=True"):
        with summon_full_params(sharded, rank0_only=True):
            pass


def test_summon_full_params():
    run_ranks(_summon, 2)


def _no_sync(rank, world_size):
    model, reference, sharded = paired_llama()
    for micro in range(3):
        x, y, lx, ly = batch_for_step(model, micro, 8, rank, world_size)
        (loss_fn(reference, reference(x), y) / 3).backward()
        if micro < 2:
            with no_sync(sharded):
                with CommDebugMode() as mode:
                    (loss_fn(sharded, sharded(lx), ly) / 3).backward()
                assert "_reduce_scatter_base_" not in comm_counts(mode)
        else:
            (loss_fn(sharded, sharded(lx), ly) / 3).backward()
    assert all(m._fsdp_state.group.requires_gradient_sync for m in sharded.modules() if isinstance(m, FSDPModule))
    check_grads_match(sharded, reference)


def test_no_sync_accumulates_then_restores():
    run_ranks(_no_sync, 2)


def _no_sync_compiled(rank, world_size):
    import unittest.mock

    import torch.distributed as dist

    import fsdp_graph

    model, reference, sharded = paired_llama()
    compiled = torch.compile(sharded, backend=fsdp_graph.backend(compiler="aot_eager"))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    calls = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    for step in range(3):  # 2 steps of 3 micro-batches (2 without sync), then a plain step
        num_micro = 3 if step < 2 else 1
        calls.clear()
        for micro in range(num_micro):
            x, y, lx, ly = batch_for_step(model, 3 * step + micro, 8, rank, world_size)
            (loss_fn(reference, reference(x), y) / num_micro).backward()
            with unittest.mock.patch.object(dist, "reduce_scatter_single", counted):
                if micro < num_micro - 1:
                    with no_sync(sharded):
                        (loss_fn(sharded, compiled(lx), ly) / num_micro).backward()
                    assert all(p.grad is None for p in sharded.parameters()), "reduced without sync"
                    assert calls == []
                else:
                    (loss_fn(sharded, compiled(lx), ly) / num_micro).backward()
        check_grads_match(sharded, reference)
        # Accumulating steps reduce once, on the eager runtime; the plain step runs the graph,
        # whose reduce-scatters are functional collectives, not eager calls.
        assert len(calls) == (3 if step < 2 else 0), (step, len(calls))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return dict(sharded._fsdp_state.ctx.fallbacks)


def test_no_sync_compiled_accumulates_on_the_eager_hooks():
    fallbacks = run_ranks(_no_sync_compiled, 2)
    assert_every_llama_group_fell_back(fallbacks, "gradient sync is off")


def _bf16_hook_compiled(rank, world_size):
    import fsdp_graph

    model, reference, eager = paired_llama()
    traced = shard_llama(copy.deepcopy(model), fully_shard)
    for m in (eager, traced):
        register_comm_hook(m, None, bf16_compress_hook, recurse=True)
    compiled = torch.compile(traced, backend=fsdp_graph.backend(compiler="aot_eager"))
    for step in range(2):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(reference, reference(x), y).backward()
        loss_fn(eager, eager(lx), ly).backward()
        loss_fn(traced, compiled(lx), ly).backward()
        check_grads_match(traced, reference, rtol=2e-2, atol=2e-3)  # the unsharded model, bf16 tolerance
        reference.zero_grad()
        eager_grads = {n: p.grad.to_local() for n, p in eager.named_parameters()}
        for name, p in traced.named_parameters():  # the same hook ran: bit for bit
            assert torch.equal(p.grad.to_local(), eager_grads[name]), name
            p.grad = None
        eager.zero_grad()
    return dict(traced._fsdp_state.ctx.fallbacks)


def test_comm_hook_compiled_runs_on_the_eager_hooks():
    fallbacks = run_ranks(_bf16_hook_compiled, 2)
    assert_every_llama_group_fell_back(fallbacks, "comm hook")


def _bf16_hook(rank, world_size):
    model, reference, sharded = paired_llama()
    register_comm_hook(sharded, None, bf16_compress_hook, recurse=True)
    lx, ly = backward_on_both(reference, sharded, 0, rank, world_size)
    for p in sharded.parameters():
        assert p.grad.dtype == torch.float32
    check_grads_match(sharded, reference, rtol=2e-2, atol=2e-3)  # bf16 has 8 bits of mantissa
    with pytest.raises(ValueError, match="already registered"):
        register_comm_hook(sharded, None, bf16_compress_hook)


def test_bf16_compress_hook_within_bf16_tolerance():
    run_ranks(_bf16_hook, 2)


def _conveniences_compiled(rank, world_size, strategy):
    """Under backend="fsdp_graph": a wrap-policy model with an FSDP1 strategy trains like the
    unsharded model and bitwise like eager; then summon_full_params edits and full_state_dict
    read the compiled model, and compiled training goes on from the edit."""
    import fsdp_graph

    torch.manual_seed(0)
    model = tiny_llama()

    def shard(m):
        return wrap(m, ModuleWrapPolicy({Block}), **strategy_kwargs(strategy))[0]

    backend = fsdp_graph.backend(compiler="aot_eager")
    result = train_compiled_and_compare(model, shard, backend, rank, world_size, steps=2)
    assert result["fallbacks"] == {}, result["fallbacks"]

    reference, sharded = copy.deepcopy(model), shard(copy.deepcopy(model))
    compiled = torch.compile(sharded, backend=backend)
    backward_on_both(reference, sharded, 0, rank, world_size)  # an eager step first
    _, _, lx, ly = batch_for_step(model, 1, 8, rank, world_size)
    loss_fn(sharded, compiled(lx), ly)  # compile (forward only)
    with summon_full_params(sharded, writeback=True):
        with torch.no_grad():
            sharded.output.weight.mul_(0.5)
    with torch.no_grad():
        reference.output.weight.mul_(0.5)
    for m in (reference, sharded):
        m.zero_grad()
    x, y, lx, ly = batch_for_step(model, 2, 8, rank, world_size)
    loss_fn(reference, reference(x), y).backward()
    loss_fn(sharded, compiled(lx), ly).backward()  # the compiled step sees the edit
    check_grads_match(sharded, reference)
    full = full_state_dict(sharded, rank0_only=False)
    for k, v in reference.state_dict().items():
        assert torch.equal(full[k], v), k
    return dict(sharded._fsdp_state.ctx.fallbacks)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_conveniences_compiled(strategy):
    assert run_ranks(_conveniences_compiled, 2, strategy) == {}
