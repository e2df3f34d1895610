"""Long-running jobs: resume from a checkpoint exactly, repeat exactly, run 1000 steps without growing,
recover from a forward that raised under compile.

Two gloo ranks, fp32 on CPU, so "exactly" means bitwise. Eager and compiled (`aot_eager`).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import fsdp_graph
from _harness import run_ranks
from _models import batch_for_step, Boom, check_grads_match, check_params_match, loss_fn, MLPStack, shard_blocks_then_root, shard_llama, tiny_llama
from fsdp_graph import fully_shard

NUM_STEPS = 6
RESUME_AT = 3
WARM_UP_STEPS = 300  # of the long run; see test_1000_steps_heap_and_tensors_flat


def _maybe_compile(model: nn.Module, compiled: bool):
    return torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else model


def _train(rank, world_size, compiled, steps, load_from=None, save_to=None):
    """Train a sharded tiny Llama over `steps` (a range of step indices); optionally load a DCP
    checkpoint first and save one after. Returns this rank's losses and final local shards."""
    torch.manual_seed(0 if load_from is None else 1)  # resumed: every number must come from the checkpoint
    model = shard_llama(tiny_llama(), fully_shard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if load_from is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=load_from)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    run = _maybe_compile(model, compiled)
    losses = []
    for step in steps:
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        loss = loss_fn(model, run(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if save_to is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=save_to)
    shards = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
    return losses, shards


@functools.lru_cache(maxsize=None)
def _uninterrupted(compiled: bool):
    return run_ranks(_train, 2, compiled, range(NUM_STEPS))


def _assert_bitwise(got, expected):
    (losses, shards), (ref_losses, ref_shards) = got, expected
    assert losses == ref_losses  # floats of fp32 losses: equal means bit for bit
    for name, shard in ref_shards.items():
        assert torch.equal(shards[name], shard), name


# compiled: over 7 s on a 2-core machine (docs/testing.md)
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_resume_from_dcp_checkpoint_is_bitwise(compiled):
    path = tempfile.mkdtemp(prefix="fsdp_graph_resume_")
    first, _ = run_ranks(_train, 2, compiled, range(RESUME_AT), None, path)
    second, shards = run_ranks(_train, 2, compiled, range(RESUME_AT, NUM_STEPS), path)  # new processes
    _assert_bitwise((first + second, shards), _uninterrupted(compiled))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_same_seed_gives_bitwise_identical_runs(compiled):
    _assert_bitwise(run_ranks(_train, 2, compiled, range(NUM_STEPS)), _uninterrupted(compiled))


# -- long runs -------------------------------------------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (RSS overstates: glibc keeps freed pages)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _runtime_residue(model: nn.Module) -> dict:
    """What a finished step must not leave behind, per root: gathered storage, hooks, work."""
    ctx = model._fsdp_state.ctx
    groups = [s.group for s in ctx.states if s.group is not None]
    return {
        "unsharded_bytes": sum(
            p._unsharded_padded.untyped_storage().nbytes() for g in groups for p in g.params if p._unsharded_padded is not None
        ),
        "grad_hooks": sum(
            len(p.unsharded_param._post_accumulate_grad_hooks or {}) for g in groups for p in g.params if p.unsharded_param is not None
        ),
        "module_hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "pending_reduce_scatters": len(ctx.comm.pending_reduce_scatters),
        "in_flight_all_gathers": sum(g._all_gather is not None for g in groups),
        "not_idle": [s.name for s in ctx.states if s.training_state.name != "IDLE"],
        "not_sharded": [g.name for g in groups if g.state.name != "SHARDED"],
    }


def _long_run(rank, world_size, num_steps, checkpoints):
    torch.manual_seed(0)
    model = MLPStack(dim=16, hidden=8, num_blocks=2)
    shard_blocks_then_root(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 16)
    y = torch.randn(4)
    samples = {}
    for step in range(1, num_steps + 1):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del loss
        if step in checkpoints:
            gc.collect()
            samples[step] = {
                "heap_bytes": _heap_in_use(),
                "live_tensors": sum(isinstance(o, torch.Tensor) for o in gc.get_objects()),
                **_runtime_residue(model),
            }
    return samples


@pytest.mark.slow  # over 13 s on a quiet 2-core machine (docs/testing.md)
def test_1000_steps_heap_and_tensors_flat():
    samples = run_ranks(_long_run, 2, 1000, (100, WARM_UP_STEPS, 1000))
    at_100, at_1000 = samples[100], samples[1000]
    assert at_1000["live_tensors"] == at_100["live_tensors"], samples
    # The heap settles by step WARM_UP_STEPS: between steps 100 and 300 it grows by ~1.4 MiB, a
    # third of which a plain model all-reducing its gradients over gloo grows too. After that,
    # glibc's in-use bytes move by a few KiB; a leak of one small tensor or hook per step would
    # add more than 64 KiB over 700 steps.
    assert abs(at_1000["heap_bytes"] - samples[WARM_UP_STEPS]["heap_bytes"]) < 64 * 1024, samples
    for key in ("unsharded_bytes", "grad_hooks", "module_hooks", "pending_reduce_scatters", "in_flight_all_gathers"):
        assert at_1000[key] == at_100[key], (key, samples)
    assert at_1000["unsharded_bytes"] == 0 and at_1000["in_flight_all_gathers"] == 0
    assert at_1000["pending_reduce_scatters"] == 0
    assert at_1000["not_idle"] == [] and at_1000["not_sharded"] == []


def _compiled_run(rank, world_size, num_steps, warm_up):
    from torch._dynamo.utils import counters, guard_failures

    torch.manual_seed(0)
    model = shard_llama(tiny_llama(), fully_shard)
    run = _maybe_compile(model, True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = {}
    for step in range(num_steps):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        loss_fn(model, run(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 in (warm_up, num_steps):
            seen[step + 1] = {
                "graphs": counters["stats"]["unique_graphs"],
                "frames": counters["frames"]["ok"],
                "guard_failures": sum(len(v) for v in guard_failures.values()),
                "fallbacks": dict(model._fsdp_state.ctx.fallbacks),
            }
    return seen


def test_compiled_does_not_recompile_after_warm_up():
    seen = run_ranks(_compiled_run, 2, 50, 2)
    assert seen[50]["graphs"] == seen[2]["graphs"] >= 1, seen
    assert seen[50]["frames"] == seen[2]["frames"], seen
    assert seen[50]["guard_failures"] == 0, seen  # none at all, warm-up included
    assert seen[50]["fallbacks"] == {}, seen


# -- a forward that raises under compile -----------------------------------------------------------


def _compiled_error_recovery(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(Boom(), Boom(), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    for m in (model[0], model[1], model):
        fully_shard(m)
    compiled = _maybe_compile(model, True)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    local = slice(rank * 2, (rank + 1) * 2)
    for step in range(4):
        x = torch.randn(4, 4)
        if step == 1:
            model[1].fail = True
            with pytest.raises(RuntimeError, match="user error"):
                compiled(x[local])
            model[1].fail = False
        compiled(x[local]).sum().backward()
        (reference(x).sum() / world_size).backward()
        check_grads_match(model, reference)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert _runtime_residue(model)["not_sharded"] == [] and _runtime_residue(model)["not_idle"] == []
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    check_params_match(model, reference)


def test_compiled_forward_error_leaves_model_usable():
    run_ranks(_compiled_error_recovery, 2)
