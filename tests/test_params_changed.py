"""Parameters changed between steps, and backwards that write no parameter gradient (issue #29 items
1, 2 and 13), against torch's `fully_shard` and an unsharded model, eager and compiled, on 2 gloo ranks.

FSDP2 accepts `requires_grad_` and `model.to(dtype)` on a sharded model: see [Note: Parameters
changed after fully_shard] in runtime/param.py. It issues no reduce-scatter for a backward that
writes no parameter gradient: see [Note: A backward that writes no parameter gradient] in
runtime/state.py.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_graph
from _harness import run_ranks
from _models import batch_for_step, check_grads_match, check_params_match, loss_fn, MLPStack, shard_blocks_then_root
from fsdp_graph import MixedPrecisionPolicy, fully_shard


class CollectiveCounter(TorchDispatchMode):
    """Collectives by op name, and the dtypes each moved. CommDebugMode's module tracker cannot run
    `torch.autograd.grad` on a leaf input ("A leaf node was passed to _will_engine_execute_node"),
    so this counts at dispatch only: eager c10d ops and the graphs' functional collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}
        self.dtypes: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            name = func.__name__.split(".")[0]
            self.counts[name] = self.counts.get(name, 0) + 1
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.dtypes.setdefault(name, set()).add(str(first.dtype).removeprefix("torch."))
        return func(*args, **(kwargs or {}))


def _shard(model, fs, **kwargs):
    return shard_blocks_then_root(model, fs, **kwargs)


def _models(dtype=torch.float32, frozen=(), **kwargs):
    """(unsharded reference, ours, torch's) copies of one seeded MLPStack, `frozen` parameters
    frozen before sharding."""
    torch.manual_seed(0)
    model = MLPStack().to(dtype)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    ours_kwargs = {k: MixedPrecisionPolicy(**v) for k, v in kwargs.items()}
    theirs_kwargs = {k: TorchMixedPrecisionPolicy(**v) for k, v in kwargs.items()}
    return (
        copy.deepcopy(model),
        _shard(copy.deepcopy(model), fully_shard, **ours_kwargs),
        _shard(copy.deepcopy(model), torch_fully_shard, **theirs_kwargs),
    )


def _check_same_grads(ours, theirs):
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        q = theirs_params[name]
        assert (p.grad is None) == (q.grad is None), f"{name}: grad is None {p.grad is None} vs torch's {q.grad is None}"
        if p.grad is not None:
            assert p.grad.dtype == q.grad.dtype, name
            torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def _block(i):
    return {f"blocks.{i}.{layer}.{kind}" for layer in ("up", "down") for kind in ("weight", "bias")}


# Names frozen before each step, the first already before fully_shard: whole groups (blocks.2,
# then blocks.0) and parts of groups (a LoRA-style split), unfrozen again later, then all trainable.
_FROZEN = [
    _block(2) | {"blocks.1.up.weight"},
    _block(0) | {"head.weight"},
    {"blocks.0.down.weight", "blocks.0.down.bias", "inp.weight", "blocks.2.up.weight"},
    set(),
]


def _freeze_and_unfreeze(rank, world_size, compiled):
    reference, ours, theirs = _models(frozen=_FROZEN[0])
    models = (reference, ours, theirs) if not compiled else (reference, ours)
    # Built once, before any freezing: a parameter unfrozen later was in the param groups all along.
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    run = torch.compile(ours, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else ours
    torch._dynamo.utils.counters.clear()
    for step, frozen in enumerate(_FROZEN):
        for m in models:
            for name, p in m.named_parameters():
                p.requires_grad_(name not in frozen)
        x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
        loss_fn(reference, reference(x), y).backward()
        loss_fn(ours, run(lx), ly).backward()
        if not compiled:
            loss_fn(theirs, theirs(lx), ly).backward()
            _check_same_grads(ours, theirs)
        check_grads_match(ours, reference)  # values, and None exactly where the reference has None
        assert {name for name, p in ours.named_parameters() if p.grad is None} == frozen, step
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    check_params_match(ours, reference, atol=1e-5)
    if compiled:
        assert ours._fsdp_state.ctx.fallbacks == {}
        return dict(torch._dynamo.utils.counters["stats"])
    return None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_freeze_and_unfreeze_between_steps(compiled):
    stats = run_ranks(_freeze_and_unfreeze, 2, compiled)
    if compiled:  # Dynamo guards on requires_grad: each new set of frozen parameters recompiles
        assert stats["unique_graphs"] >= 3, stats


def _steps(models, run, steps, rank, world_size, dtype, theirs=None):
    """Train `models` (reference first, ours second) `steps` steps in `dtype`, ours through `run`,
    checking every gradient against the reference and torch's `theirs`; returns the dtypes our
    backward's collectives moved (its re-gathers and reduce-scatters)."""
    reference, ours = models[:2]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    counter = CollectiveCounter()
    for step in steps:
        x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
        loss_fn(reference, reference(x.to(dtype)), y.to(dtype)).backward()
        out = run(lx.to(dtype))
        with counter:  # backward only: Dynamo does not trace under a dispatch mode
            loss_fn(ours, out, ly.to(out.dtype)).backward()
        if theirs is not None:
            out = theirs(lx.to(dtype))
            loss_fn(theirs, out, ly.to(out.dtype)).backward()
            _check_same_grads(ours, theirs)
        assert all(p.dtype == dtype and p.grad.dtype == dtype for p in ours.parameters())
        check_grads_match(ours, reference)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    check_params_match(ours, reference, atol=1e-5)
    return {name: sorted(dtypes) for name, dtypes in counter.dtypes.items()}


def _convert_dtype(rank, world_size, compiled):
    results = {}

    def compile(model):
        torch._dynamo.reset()  # each model's own recompiles, not Dynamo's limit over all of them
        return torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager"))

    # fp32 shards converted to fp64 after a step, and back (FSDP2 refuses a conversion after its
    # first forward, so only the unsharded model to compare with). Compiled too: the conversion
    # swaps the DTensor parameters, which the compiled step must leave swappable ([Note:
    # Parameters swapped after a compile] in fsdp_graph/compile/backend.py).
    reference, ours, _ = _models()
    run = compile(ours) if compiled else ours
    results["fp32"] = _steps((reference, ours), run, [0], rank, world_size, torch.float32)
    for m in (reference, ours):
        m.to(torch.float64)
    results["fp32 -> fp64"] = _steps((reference, ours), run, [1, 2], rank, world_size, torch.float64)
    for m in (reference, ours):
        m.to(torch.float32)
    results["fp64 -> fp32"] = _steps((reference, ours), run, [3], rank, world_size, torch.float32)
    if compiled:
        assert ours._fsdp_state.ctx.fallbacks == {}, ours._fsdp_state.ctx.fallbacks
    # Converted after fully_shard, before the first forward, as torch's fully_shard allows: a bf16
    # model to fp32, and an fp32 model under a policy that gathers and reduces in fp32 to fp64.
    cases = {
        "bf16 -> fp32": (torch.bfloat16, torch.float32, {}),
        "fp32 -> fp64, policy fp32": (
            torch.float32, torch.float64, {"mp_policy": {"param_dtype": torch.float32, "reduce_dtype": torch.float32}},
        ),
    }
    for name, (dtype, new_dtype, kwargs) in cases.items():
        reference, ours, theirs = _models(dtype, **kwargs)
        for m in (reference, ours, theirs):
            m.to(new_dtype)
        run = compile(ours) if compiled else ours
        results[name] = _steps(
            (reference, ours, theirs), run, [0, 1], rank, world_size, new_dtype, theirs=None if compiled else theirs
        )
        assert ours._fsdp_state.ctx.fallbacks == {}, (name, ours._fsdp_state.ctx.fallbacks)
    return results


# compiled: over 7 s on a 2-core machine (docs/testing.md)
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_convert_dtype_after_fully_shard(compiled):
    dtypes = run_ranks(_convert_dtype, 2, compiled)
    all_gather, reduce_scatter = ("all_gather_into_tensor", "reduce_scatter_tensor") if compiled else (
        "_allgather_base_", "_reduce_scatter_base_"
    )
    # The shards' dtype is the collectives' dtype, unless the policy names one.
    expected = {"bf16 -> fp32": "float32", "fp32 -> fp64, policy fp32": "float32",
                "fp32": "float32", "fp32 -> fp64": "float64", "fp64 -> fp32": "float32"}
    assert sorted(dtypes) == sorted(expected)
    for name, dtype in expected.items():
        moved = dtypes[name]  # compiled: the backward's re-gathers write into the group's row or a new tensor
        gathered = sorted({d for op, op_dtypes in moved.items() if op.startswith(all_gather) for d in op_dtypes})
        assert gathered == [dtype] and moved[reduce_scatter] == [dtype], (name, moved)


def _input_gradient_only(rank, world_size, compiled):
    """An ordinary step, `torch.autograd.grad(loss, inputs=[x])`, an ordinary step: the collectives
    of each backward, ours and torch's, and every gradient against the unsharded model."""
    reference, ours, theirs = _models()
    run = torch.compile(ours, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else ours
    counts = {"ours": [], "theirs": []}
    for step, kind in enumerate(["backward", "input grad", "backward"]):
        x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
        x.requires_grad_(True)
        ref_loss = loss_fn(reference, reference(x), y)
        for name, model, call in (("ours", ours, run), ("theirs", theirs, theirs)):
            local = lx.clone().requires_grad_(True)
            loss = loss_fn(model, call(local), ly)
            counter = CollectiveCounter()
            with counter:  # backward only: Dynamo does not trace under a dispatch mode
                if kind == "backward":
                    loss.backward()
                else:
                    (input_grad,) = torch.autograd.grad(loss, inputs=[local])
            counts[name].append(counter.counts)
            if kind == "backward":
                continue
            assert all(p.grad is None for p in model.parameters()), name
            # The local loss averages world_size times fewer samples than the global one.
            (ref_input_grad,) = torch.autograd.grad(ref_loss, inputs=[x], retain_graph=True)
            rows = slice(rank * lx.shape[0], (rank + 1) * lx.shape[0])
            torch.testing.assert_close(input_grad, ref_input_grad[rows] * world_size, rtol=1e-5, atol=1e-7)
        if kind == "backward":
            ref_loss.backward()
            _check_same_grads(ours, theirs)
            check_grads_match(ours, reference)
            for model in (reference, ours, theirs):
                model.zero_grad()
    assert ours._fsdp_state.ctx.fallbacks == {}
    return counts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_input_gradient_only_reduces_nothing(compiled):
    counts = run_ranks(_input_gradient_only, 2, compiled)
    ours, theirs = counts["ours"], counts["theirs"]
    assert theirs[1] == {"_allgather_base_": 3}  # torch's: the blocks' re-gathers, no reduce-scatter
    assert theirs[0] == theirs[2] == {"_allgather_base_": 3, "_reduce_scatter_base_": 4}
    if not compiled:
        assert ours == theirs
        return
    # Compiled, the backward is one autograd node whose graph reduce-scatters every group (in the
    # buckets the passes made); it runs whole for torch.autograd.grad too, so that backward issues
    # the collectives of an ordinary one (the first backward's count includes compiling it). The
    # parameters' `.grad` stay None all the same: checked in _input_gradient_only.
    assert ours[1] == ours[2] and ours[1]["reduce_scatter_tensor"] >= 1, ours
