"""Training-loop patterns users write, against the unsharded model on the global batch.

Each rank computes on its half of the global batch; the reference is one unsharded copy of the model
computing the whole batch the same way (a rank's data-dependent choices are the reference's choices
for that half). Losses, every gradient (None-ness included) and the parameters after AdamW steps
must match.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, namedtuple
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _harness import run_ranks
from _models import shard_blocks_then_root

DIM = 8


class Experts(nn.Module):
    """Three same-shaped experts in one group; `route` says which ones this batch uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.c = nn.Linear(DIM, DIM)  # no rank ever routes here: its gradient stays None

    def forward(self, x: torch.Tensor, route: str) -> torch.Tensor:
        return x + sum(getattr(self, name)(x) for name in route)


class Routed(nn.Module):
    """Two expert layers with per-rank routing. With the routes below, rank 0 uses everything of
    layers[1] but not of layers[0], rank 1 the other way round, so each rank's layers complete
    their gradients in a different order (the reduce-scatters must still pair up)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Experts(), Experts()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, routes: tuple[str, str]) -> torch.Tensor:
        h = self.inp(x)
        for layer, route in zip(self.layers, routes):
            h = layer(h, route)
        return self.head(h).squeeze(-1)


ROUTES = {0: ("a", "ab"), 1: ("ab", "b")}  # per rank: the experts of layers[0], layers[1]


def _shard(model: nn.Module, compiled: bool):
    from fsdp_graph import fully_shard

    shard_blocks_then_root(model)
    return torch.compile(model, backend="fsdp_graph", options={"compiler": "aot_eager"}) if compiled else model


def _check_grads(sharded: nn.Module, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        if ref[name].grad is None:
            assert param.grad is None, f"{name}: no rank used it, but it has a gradient"
            continue
        assert param.grad is not None, f"{name}: the reference has a gradient, the sharded model none"
        torch.testing.assert_close(param.grad.full_tensor(), ref[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def _check_params(sharded: nn.Module, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        torch.testing.assert_close(param.full_tensor(), ref[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _routed(rank, world_size, compiled):
    torch.manual_seed(0)
    reference = Routed()
    sharded_model = copy.deepcopy(reference)
    sharded = _shard(sharded_model, compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded_model)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, DIM, generator=gen), torch.randn(2, 4, generator=gen)
        ref_loss = sum(F.mse_loss(reference(x[r], ROUTES[r]), y[r]) for r in range(2)) / 2
        ref_loss.backward()
        F.mse_loss(sharded(x[rank], ROUTES[rank]), y[rank]).backward()
        _check_grads(sharded_model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _check_params(sharded_model, reference)
    assert sharded_model._fsdp_state.ctx.fallbacks == {}, sharded_model._fsdp_state.ctx.fallbacks  # compiled: all in the graph


@pytest.mark.parametrize("compiled", [False, True])
def test_ranks_using_different_parameters_of_a_group(compiled):
    """A parameter used on any rank gets the averaged gradient on every rank, one used on none keeps
    None; the groups reduce in one order on both ranks although their gradients complete in
    different orders."""
    run_ranks(_routed, 2, compiled)


class TopOneExperts(nn.Module):
    """A router and three experts in one group. Each token goes to its router's top expert, and an
    expert that got no token is not called (as HF's Mixtral calls only the experts hit): its
    parameters get no gradient on that rank. The data-dependent loop breaks the graph, so in a
    compiled step this group runs on the eager hooks between traced groups."""

    def __init__(self, num_experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, num_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.ReLU(), nn.Linear(2 * DIM, DIM)) for _ in range(num_experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        route = probs.argmax(-1)
        out = torch.zeros_like(x)
        for e in route.unique().tolist():
            rows = (route == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](x[rows]) * probs[rows, e:e + 1])
        return x + out


class DenseMoEDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.dense0 = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.moe = TopOneExperts()
        self.dense1 = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dense1(self.moe(self.dense0(self.inp(x))))).squeeze(-1)


def _routed_block(rank, world_size, compiler):
    import torch.distributed as dist

    import fsdp_graph
    from fsdp_graph import fully_shard

    torch.manual_seed(7)  # every step, one rank's tokens reach every expert, the other's not
    reference = DenseMoEDense()
    model = copy.deepcopy(reference)
    for block in (model.dense0, model.moe, model.dense1):
        fully_shard(block)
    fully_shard(model)
    run = model if compiler is None else torch.compile(model, backend=fsdp_graph.backend(compiler=compiler))
    hit: list[set] = []  # the reference's experts called, per step and rank
    for e, expert in enumerate(reference.moe.experts):
        expert.register_forward_hook(lambda *_, e=e: hit[-1].add(e))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 6, DIM, generator=gen), torch.randn(2, 6, generator=gen)
        ref_losses = []
        for r in range(2):
            hit.append(set())
            ref_losses.append(F.mse_loss(reference(x[r]), y[r]))
        (sum(ref_losses) / 2).backward()
        loss = F.mse_loss(run(x[rank]), y[rank])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / 2, sum(ref_losses).detach() / 2, rtol=1e-5, atol=1e-6)
        _check_grads(model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _check_params(model, reference)
    return [(hit[i], hit[i + 1]) for i in range(0, len(hit), 2)], set(model._fsdp_state.ctx.fallbacks)


@pytest.mark.parametrize("compiler", [None, "aot_eager", "inductor"])
def test_routed_block_with_an_expert_idle_on_one_rank(compiler):
    """An MoE block (router and experts one group) whose experts get tokens on one rank and none on
    the other, between traced blocks: the compiled step waited for ever (the idle rank held the
    block's reduce-scatter for its missing gradients while the traced block before it reduced:
    [Note: A fallback group's backward ends at its inputs] in runtime/param_group.py). Losses,
    every gradient and the final parameters as the unsharded model on the global batch. Torch's
    fully_shard aborts in gloo here, eager and compiled, so it gives no reference."""
    hits, fallbacks = run_ranks(_routed_block, 2, compiler, timeout_s=150)
    # Every step, one rank's tokens reached all three experts, the other rank's fewer (both ways round).
    assert all(max(len(a), len(b)) == 3 > min(len(a), len(b)) for a, b in hits), hits
    assert {len(a) == 3 for a, _ in hits} == {True, False}, hits
    if compiler is not None:
        assert fallbacks == {"<root>", "moe"}, fallbacks  # dense0 and dense1 traced, around the MoE


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    extra: tuple
    note: str = "plain data rides along"


Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Hidden:
    """A plain (mutable) dataclass."""

    states: torch.Tensor
    layer: int = 0


@dataclasses.dataclass
class ModelOutputLike(OrderedDict):
    """Stands in for transformers' `ModelOutput` (not installed here): a dataclass that is also an
    OrderedDict of its non-None fields, items and attributes kept in step."""

    logits: Optional[torch.Tensor] = None
    hidden: Optional[Hidden] = None
    loss: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name, value) -> None:
        if name in self.keys():
            super().__setitem__(name, value)
        super().__setattr__(name, value)


class DataclassOutput(nn.Module):
    """Returns its tensors inside a dict of a frozen dataclass holding a namedtuple, None and a str,
    or (`model_output`) in a ModelOutput-like dataclass holding a plain dataclass."""

    def __init__(self, model_output: bool = False) -> None:
        super().__init__()
        self.model_output = model_output
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        if self.model_output:
            return ModelOutputLike(logits=self.head(h).squeeze(-1), hidden=Hidden(h, layer=2))
        return {"out": Out(self.head(h).squeeze(-1), extra=(Pair(h, None), 3))}


def _logits_of(output):
    if isinstance(output, ModelOutputLike):
        assert isinstance(output.hidden, Hidden) and output.loss is None and list(output.keys()) == ["logits", "hidden"]
        return output["logits"]
    out = output["out"]
    assert isinstance(out, Out) and isinstance(out.extra[0], Pair) and out.note == "plain data rides along"
    return out.logits


def _dataclass_output(rank, world_size, compiled, model_output):
    torch.manual_seed(0)
    reference = DataclassOutput(model_output)
    sharded_model = copy.deepcopy(reference)
    sharded = _shard(sharded_model, compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded_model)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, DIM, generator=gen), torch.randn(8, generator=gen)
        local = slice(4 * rank, 4 * rank + 4)
        F.mse_loss(_logits_of(reference(x)), y).backward()
        F.mse_loss(_logits_of(sharded(x[local])), y[local]).backward()
        _check_grads(sharded_model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _check_params(sharded_model, reference)
    assert sharded_model._fsdp_state.ctx.fallbacks == {}


@pytest.mark.parametrize("model_output", [False, True], ids=["dict_of_frozen_dataclass", "model_output_like"])
@pytest.mark.parametrize("compiled", [False, True])
def test_output_inside_a_dataclass(compiled, model_output):
    run_ranks(_dataclass_output, 2, compiled, model_output)


def test_output_dtype_reaches_tensors_inside_dataclasses():
    """MixedPrecisionPolicy(output_dtype=...) casts the tensors a dataclass output holds."""
    from fsdp_graph.runtime.trees import cast_floats, tensors_in

    logits = torch.ones(2)
    tree = {"out": Out(logits, extra=(Pair(logits, None), 3))}
    cast = cast_floats(tree, torch.float64)
    assert [t.dtype for t in tensors_in(cast)] == [torch.float64, torch.float64]
    assert cast["out"].extra[1] == 3 and cast["out"].extra[0].second is None
    assert [t.dtype for t in tensors_in(tree)] == [torch.float32, torch.float32]  # the input is left as it was

    output = ModelOutputLike(logits=logits, hidden=Hidden(logits, layer=2))
    cast = cast_floats(output, torch.float64)
    assert type(cast) is ModelOutputLike and type(cast.hidden) is Hidden and cast.hidden.layer == 2
    assert cast.logits.dtype == cast["logits"].dtype == cast.hidden.states.dtype == torch.float64
    assert cast.loss is None and list(cast.keys()) == ["logits", "hidden"]
    assert [t.dtype for t in tensors_in(output)] == [torch.float32, torch.float32]


# -- the differential test of training loops ------------------------------------------------------
#
# A loop is a combination of patterns users write. Each drawn combination trains the same model three
# ways on 2 ranks, eager and compiled (aot_eager): fsdp_graph, torch's fully_shard (where it finishes:
# not with per-rank routing, which it cannot reduce), and the unsharded model on the global batch.
# After every backward every gradient (None-ness included) is compared; after the loop the
# parameters, the optimizer states and a no_grad inference. `pytest --loop-fuzz N` draws N more.


@dataclasses.dataclass(frozen=True)
class Loop:
    routed: bool = False  # ranks route through different experts (the routing case above)
    output: str = "plain"  # "plain", "dataclass" (a dict of a frozen dataclass), "tuple" (with an int)
    argmax_gate: bool = False  # a gate behind argmax: its weight never gets a gradient
    eval_between: bool = False  # model.eval() and a no_grad forward between steps, then train()
    seq_lens: tuple = (4,)  # sequence length of each step, cycled
    reuse_block: bool = False  # blocks[0] is called twice in one forward
    accumulate: int = 1  # micro-batches per step, gradient sync off for all but the last
    two_optimizers: bool = False  # SGD with momentum for the blocks, AdamW for the rest
    set_to_none: bool = True  # zero_grad(set_to_none=...)
    # "outside": the model is compiled and the loss computed after it; "inside": a compiled function
    # computes model and loss (eval and inference then call the model uncompiled).
    loss: str = "outside"
    steps: int = 3


CHOICES = {
    "routed": [False, True], "output": ["plain", "dataclass", "tuple"], "argmax_gate": [False, True],
    "eval_between": [False, True], "seq_lens": [(4,), (4, 6)], "reuse_block": [False, True],
    "accumulate": [1, 2], "two_optimizers": [False, True], "set_to_none": [True, False],
    "loss": ["outside", "inside"],
}
# The three cases first, then drawn combinations: seeds 0, 1 and 5 together draw every
# choice above at least once (the loss inside a compiled function with per-rank routing and the gate
# behind argmax, seed 5).
DEFAULT_LOOPS = [Loop(routed=True), Loop(output="dataclass"), Loop(argmax_gate=True)]
DEFAULT_SEEDS = (0, 1, 5)


def draw_loops(seeds) -> list[Loop]:
    import random

    loops = []
    for seed in seeds:
        rng = random.Random(seed)
        loops.append(Loop(**{name: rng.choice(options) for name, options in CHOICES.items()}))
    return loops


class LoopModel(nn.Module):
    def __init__(self, loop: Loop) -> None:
        super().__init__()
        self.loop = loop
        self.inp = nn.Linear(DIM, DIM)
        self.gate = nn.Linear(DIM, 2)
        self.blocks = nn.ModuleList([Experts(), Experts()])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, routes: tuple[str, str]):
        h = self.inp(x)
        if self.loop.argmax_gate:
            h = h * (1 + self.gate(h).argmax(-1, keepdim=True))  # no gradient reaches the gate
        for block, route in zip(self.blocks, routes):
            h = block(h, route)
        if self.loop.reuse_block:
            h = self.blocks[0](h, routes[0])
        logits = self.head(h).squeeze(-1)
        if self.loop.output == "dataclass":
            return {"out": Out(logits, extra=(Pair(h, None), 3))}
        if self.loop.output == "tuple":
            return logits, 7
        return logits


def _logits(output):
    if isinstance(output, dict):
        return output["out"].logits
    return output[0] if isinstance(output, tuple) else output


def _optimizers(model: nn.Module, loop: Loop) -> list:
    if not loop.two_optimizers:
        return [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return [torch.optim.SGD(blocks, lr=1e-2, momentum=0.9), torch.optim.AdamW(rest, lr=1e-2)]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _states(optimizers) -> list:
    """Every optimizer state tensor, full (unsharded), in a fixed order."""
    return [_full(value) for opt in optimizers for group in opt.param_groups for p in group["params"]
            for _, value in sorted(opt.state[p].items()) if torch.is_tensor(value)]


def _runners(model: nn.Module, loop: Loop, compile_kwargs: Optional[dict]):
    """(forward, loss_of): how the loop calls `model`, compiled with `compile_kwargs` unless None."""
    forward = model
    if compile_kwargs is not None and loop.loss == "outside":
        forward = torch.compile(model, **compile_kwargs)

    def loss_of(x, y, route):
        return F.mse_loss(_logits(forward(x, route)), y)

    if compile_kwargs is not None and loop.loss == "inside":
        return forward, torch.compile(loss_of, **compile_kwargs)
    return forward, loss_of


def _train_loop(loop: Loop, model: nn.Module, compile_kwargs: Optional[dict], rank: int, global_view: bool) -> dict:
    """Train `model` with `loop`, compiled as `_runners` says; on the global batch when `global_view`."""
    run, loss_of = _runners(model, loop, compile_kwargs)
    optimizers = _optimizers(model, loop)
    record = {"losses": [], "grads": [], "evals": []}
    routes = [ROUTES[r] if loop.routed else ("ab", "ab") for r in range(2)]
    ranks = range(2) if global_view else [rank]
    for step in range(loop.steps):
        seq = loop.seq_lens[step % len(loop.seq_lens)]
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, seq, DIM, generator=gen), torch.randn(2, 4, seq, generator=gen)
        for micro in range(loop.accumulate):
            rows = slice(micro * 4 // loop.accumulate, (micro + 1) * 4 // loop.accumulate)
            if not global_view and loop.accumulate > 1:
                model.set_requires_gradient_sync(micro == loop.accumulate - 1)
            losses = [loss_of(x[r, rows], y[r, rows], routes[r]) for r in ranks]
            (sum(losses) / len(losses) / loop.accumulate).backward()
            record["losses"].append(losses[rank if global_view else 0].item())
        record["grads"].append({n: None if p.grad is None else _full(p.grad).clone() for n, p in model.named_parameters()})
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=loop.set_to_none)
        if loop.eval_between:
            model.eval()
            with torch.no_grad():
                record["evals"].append(_logits(run(x[rank], routes[rank])).clone())
            model.train()
    with torch.no_grad():
        record["inference"] = _logits(run(x[rank], routes[rank])).clone()
    record["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    record["states"] = _states(optimizers)
    return record


def _assert_same_training(got: dict, expected: dict, what: str) -> None:
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["losses"], expected["losses"], **close, msg=lambda m: f"{what} losses: {m}")
    for step, (grads, ref) in enumerate(zip(got["grads"], expected["grads"])):
        for name, grad in grads.items():
            assert (grad is None) == (ref[name] is None), f"{what} step {step} {name}: grad {grad} vs {ref[name]}"
            if grad is not None:
                torch.testing.assert_close(grad, ref[name], **close, msg=lambda m: f"{what} step {step} {name}: {m}")
    for key in ("evals", "inference", "params", "states"):
        torch.testing.assert_close(got[key], expected[key], **close, msg=lambda m: f"{what} {key}: {m}")


def _differential(rank, world_size, loops, compiled):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_graph import fully_shard

    for loop in loops:
        torch.manual_seed(0)
        reference = LoopModel(loop)
        ours, theirs = copy.deepcopy(reference), copy.deepcopy(reference)
        expected = _train_loop(loop, reference, None, rank, global_view=True)
        shard_blocks_then_root(ours)
        kwargs = dict(backend="fsdp_graph", options={"compiler": "aot_eager", "scope": compiled}) if compiled else None
        _assert_same_training(_train_loop(loop, ours, kwargs, rank, global_view=False), expected, f"fsdp_graph {loop}")
        if loop.accumulate == 1:  # without sync off, every compiled step is one graph: no group fell back
            assert ours._fsdp_state.ctx.fallbacks == {}, (loop, ours._fsdp_state.ctx.fallbacks)
        if not loop.routed:  # torch's fully_shard cannot reduce groups the ranks use differently
            shard_blocks_then_root(theirs, torch_fully_shard)
            kwargs = dict(backend="aot_eager") if compiled else None
            _assert_same_training(_train_loop(loop, theirs, kwargs, rank, global_view=False), expected, f"torch {loop}")
        torch._dynamo.reset()
    return len(loops)


# block: over 13 s on a 2-core machine (docs/testing.md)
@pytest.mark.parametrize("compiled", [False, pytest.param("step", marks=pytest.mark.slow), pytest.param("block", marks=pytest.mark.slow)])
def test_training_loops_match_the_unsharded_model_and_torch(compiled, loop_fuzz):
    """Each loop trained by the unsharded model on the global batch, by ours (eager, or compiled with
    the whole step in one graph or block by block: the backend's `scope`) and by torch's
    fully_shard (eager or compiled): the same losses, gradients, evaluations and states."""
    loops = DEFAULT_LOOPS + draw_loops(DEFAULT_SEEDS) + draw_loops(range(100, 100 + loop_fuzz))
    assert run_ranks(_differential, 2, loops, compiled, timeout_s=900) == len(loops)
