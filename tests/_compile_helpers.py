"""Training loops and graph helpers shared by the test_compile_* files."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from _models import batch_for_step, check_grads_match, check_params_match, global_mean, loss_fn

C10D = torch.ops._c10d_functional


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def train_compiled_and_compare(
    model: nn.Module,
    shard: Callable[[nn.Module], nn.Module],
    backend,
    rank: int,
    world_size: int,
    steps: int = 3,
    global_batch: int = 8,
    bitwise: bool = True,
    rtol: float = 1e-5,
    lr: float = 1e-2,
) -> dict:
    """Train three copies on the same global batch: an unsharded reference, the eager runtime, and
    `torch.compile(shard(copy), backend=backend)`; compare the compiled run with both every step.

    Against the reference: global losses within `rtol`, every sharded gradient and the final
    parameters as in `train_and_compare`. Against the eager runtime: local losses, every gradient
    shard and the final parameters, bit for bit when `bitwise`, else within `rtol`.
    Returns {"losses": [...], "max_rel_diff_vs_reference": float, "fallbacks": {module: reason}}
    (the modules whose groups ran on the eager hooks inside the compiled step).
    """
    reference = copy.deepcopy(model)
    eager = shard(copy.deepcopy(model))
    compiled_module = shard(copy.deepcopy(model))
    compiled = torch.compile(compiled_module, backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (reference, eager, compiled_module)]
    losses, max_rel = [], 0.0
    for step in range(steps):
        x, y, lx, ly = batch_for_step(model, step, global_batch, rank, world_size)
        ref_loss = loss_fn(reference, reference(x), y)
        ref_loss.backward()
        eager_loss = loss_fn(eager, eager(lx), ly)
        eager_loss.backward()
        loss = loss_fn(compiled_module, compiled(lx), ly)
        loss.backward()

        got = global_mean(loss)
        rel = abs(got - ref_loss.item()) / abs(ref_loss.item())
        max_rel = max(max_rel, rel)
        assert rel <= rtol, f"step {step}: compiled loss {got} != reference {ref_loss.item()}"
        check_grads_match(compiled_module, reference, rtol=rtol)
        _compare_with_eager(compiled_module, eager, loss, eager_loss, bitwise, rtol, f"step {step}")
        losses.append(got)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    check_params_match(compiled_module, reference, atol=1e-5)
    _compare_with_eager(compiled_module, eager, None, None, bitwise, rtol, "final parameters", params=True)
    fallbacks = dict(compiled_module._fsdp_state.ctx.fallbacks)
    return {"losses": losses, "max_rel_diff_vs_reference": max_rel, "fallbacks": fallbacks}


def train_bitwise_like_eager(model, eager, traced, compiled, rank, world_size, steps=2) -> None:
    """`steps` AdamW steps of the eager runtime (`eager`) and of `compiled` (compiling `traced`) on
    this rank's part of the same batches: the losses and every gradient shard bit for bit, and the
    parameters kept in their original dtype with gradients in it (mixed precision casts back)."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, traced)]
    for step in range(steps):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        eager_loss = loss_fn(eager, eager(x).float(), y)
        eager_loss.backward()
        loss = loss_fn(traced, compiled(x).float(), y)
        loss.backward()
        assert torch.equal(loss, eager_loss), (step, loss, eager_loss)
        eager_params = dict(eager.named_parameters())
        for name, p in traced.named_parameters():
            assert p.dtype == eager_params[name].dtype and p.grad.dtype == p.dtype, (step, name)
            assert torch.equal(p.grad.to_local(), eager_params[name].grad.to_local()), (step, name)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def _compare_with_eager(compiled, eager, loss, eager_loss, bitwise, rtol, where, params=False):
    pairs = []
    if loss is not None:
        pairs.append(("loss", loss.detach(), eager_loss.detach()))
    eager_params = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        q = eager_params[name]
        if params:
            pairs.append((name, _local(p.detach()), _local(q.detach())))
        else:
            assert (p.grad is None) == (q.grad is None), f"{where}: {name} grad presence differs"
            if p.grad is not None:
                assert type(p.grad) is type(q.grad), f"{where}: {name} grad types differ"
                pairs.append((name + ".grad", _local(p.grad), _local(q.grad)))
    for name, got, expected in pairs:
        if bitwise:
            assert torch.equal(got, expected), (
                f"{where}: {name} differs from the eager runtime by {(got - expected).abs().max().item()}"
            )
        else:
            torch.testing.assert_close(got, expected, rtol=rtol, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")


def count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (
            C10D.all_gather_into_tensor.default,
            C10D.reduce_scatter_tensor.default,
            C10D.all_reduce.default,
        ):
            name = node.target.__name__.split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def dumped_graphs(dump_dir) -> dict:
    """The one compiled graph's entry of the backend's summary.json in `dump_dir`."""
    summary = json.loads((Path(dump_dir) / "summary.json").read_text())
    (graphs,) = summary["graphs"].values()
    return graphs


def collective_groups(graphs: dict, kind: str, op: str) -> list[str]:
    """The groups of `kind`'s ("forward" / "backward") collectives `op`, in graph order."""
    return [c["group"] for c in graphs[kind]["collectives"] if c["op"] == op]


def assert_every_llama_group_fell_back(fallbacks: dict, reason: str) -> None:
    """The tiny Llama's three groups ran on the eager hooks, each logged with `reason` in its text."""
    assert sorted(fallbacks) == ["<root>", "layers.0", "layers.1"], fallbacks
    assert all(reason in why for why in fallbacks.values()), fallbacks
