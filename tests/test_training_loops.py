"""Training-loop patterns users write, against the unsharded model on the global batch.

Each rank computes on its half of the global batch; the reference is one unsharded copy of the model
computing the whole batch the same way (a rank's data-dependent choices are the reference's choices
for that half). Losses, every gradient (None-ness included) and the parameters after AdamW steps
must match.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _harness import run_ranks

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

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
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


@dataclasses.dataclass(frozen=True)
class Out:
    logits: torch.Tensor
    extra: tuple
    note: str = "plain data rides along"


Pair = namedtuple("Pair", "first second")


class DataclassOutput(nn.Module):
    """Returns its tensors inside a dict of a frozen dataclass holding a namedtuple, None and a str."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> dict:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return {"out": Out(self.head(h).squeeze(-1), extra=(Pair(h, None), 3))}


def _dataclass_output(rank, world_size, compiled):
    torch.manual_seed(0)
    reference = DataclassOutput()
    sharded_model = copy.deepcopy(reference)
    sharded = _shard(sharded_model, compiled)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded_model)]
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, DIM, generator=gen), torch.randn(8, generator=gen)
        local = slice(4 * rank, 4 * rank + 4)
        F.mse_loss(reference(x)["out"].logits, y).backward()
        out = sharded(x[local])["out"]
        assert isinstance(out, Out) and isinstance(out.extra[0], Pair) and out.note == "plain data rides along"
        F.mse_loss(out.logits, y[local]).backward()
        _check_grads(sharded_model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    _check_params(sharded_model, reference)
    assert sharded_model._fsdp_state.ctx.fallbacks == {}


@pytest.mark.parametrize("compiled", [False, True])
def test_output_inside_a_dataclass(compiled):
    run_ranks(_dataclass_output, 2, compiled)


def test_output_dtype_reaches_tensors_inside_dataclasses():
    """MixedPrecisionPolicy(output_dtype=...) casts the tensors a dataclass output holds."""
    from fsdp_graph.runtime.trees import cast_floats, tensors_in

    logits = torch.ones(2)
    tree = {"out": Out(logits, extra=(Pair(logits, None), 3))}
    cast = cast_floats(tree, torch.float64)
    assert [t.dtype for t in tensors_in(cast)] == [torch.float64, torch.float64]
    assert cast["out"].extra[1] == 3 and cast["out"].extra[0].second is None
    assert [t.dtype for t in tensors_in(tree)] == [torch.float32, torch.float32]  # the input is left as it was
