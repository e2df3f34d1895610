"""Blocks whose forward multiplies by a module-level number that the script changes between steps.

Arithmetic only, no branch: torch's `fully_shard` + `torch.compile` trains it (Dynamo compiles again
with the number unspecialized), and so must the compiled whole step, regions on or off. 2 gloo ranks,
`aot_eager`, against the unsharded model on the same global batch and against torch's `fully_shard`.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_graph
from _harness import run_ranks
from _models import MLPStack, batch_for_step, global_mean, loss_fn, shard_blocks_then_root
from fsdp_graph import fully_shard

SCALE = 1.0  # changed by the training loop between steps; read by every block's forward


class _ScaledBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) * SCALE


_SCALES = (1.0, 0.5, 2.0, 0.25)


def _train(model, run, rank, world_size, sharded):
    """AdamW steps with SCALE changed before each: (losses, gradients by step, final parameters)."""
    global SCALE
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step, scale in enumerate(_SCALES):
        SCALE = scale
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        if sharded:
            x, y = lx, ly
        loss = loss_fn(model, run(x), y)
        loss.backward()
        losses.append(global_mean(loss) if sharded else loss.item())
        grads.append({n: (p.grad.full_tensor() if sharded else p.grad).clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    params = {n: (p.full_tensor() if sharded else p).detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def _module_number_changes(rank, world_size, regions):
    torch.manual_seed(0)
    model = MLPStack(dim=8, hidden=16, block=_ScaledBlock)
    runs = {}
    for name, shard, backend in (
        ("ours", fully_shard, fsdp_graph.backend(compiler="aot_eager", regions=regions)),
        ("torch", torch_fully_shard, "aot_eager"),  # torch's fully_shard + torch.compile
    ):
        torch._dynamo.reset()
        sharded = shard_blocks_then_root(copy.deepcopy(model), shard)
        runs[name] = _train(sharded, torch.compile(sharded, backend=backend), rank, world_size, sharded=True)
    reference = copy.deepcopy(model)
    runs["unsharded"] = _train(reference, reference, rank, world_size, sharded=False)

    (losses, grads, params) = runs["ours"]
    for other in ("torch", "unsharded"):
        o_losses, o_grads, o_params = runs[other]
        torch.testing.assert_close(losses, o_losses, rtol=1e-5, atol=0, msg=lambda m: f"losses against {other}: {m}")
        for step, (step_grads, o_step_grads) in enumerate(zip(grads, o_grads)):
            for name, grad in step_grads.items():
                torch.testing.assert_close(grad, o_step_grads[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} {name} against {other}: {m}")
        for name, param in params.items():
            torch.testing.assert_close(param, o_params[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} against {other}: {m}")
    return losses


@pytest.mark.parametrize("regions", ["blocks", "marked"])
def test_module_level_number_changed_between_steps(regions):
    """Every step's loss and gradients, and the final parameters, as torch's fully_shard + torch.compile
    and the unsharded model give them (regions="blocks" raised "Freevar has no source" in Dynamo)."""
    losses = run_ranks(_module_number_changes, 2, regions)
    assert len(losses) == len(_SCALES)
