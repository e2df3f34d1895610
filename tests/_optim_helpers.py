"""What the matrix-optimizer tests share: a model of bare matrices, seeded global gradients, and the
DCP resume check."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor


class Matrices(nn.Module):
    def __init__(self, shapes) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(*s)) for s in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # fully_shard hooks a forward; the tests set gradients
        return sum(w.sum() for w in self.weights) * x


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()  # a snapshot, never a view


def global_grads(shapes, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=gen) for s in shapes]


def resume_continues_bitwise(build, shapes, path) -> dict:
    """Train `build(0)`'s model and optimizer 3 steps on global gradients, checkpoint both through
    DCP, train 2 more; a fresh `build(1)` (other weights) loaded from the checkpoint must take the
    same 2 steps bit for bit. Returns the optimizer state dict that was saved."""

    def train(model, opt, steps):
        for step in steps:
            for s, g in zip(model.weights, global_grads(shapes, step)):
                s.grad = distribute_tensor(g, s.device_mesh, s.placements)
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(3))
    model_state, saved = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": saved}, checkpoint_id=path)
    train(model, opt, range(3, 5))

    resumed, resumed_opt = build(1)  # different weights: everything must come from the checkpoint
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(resumed, resumed_opt, range(3, 5))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
        assert torch.equal(opt.state[p]["momentum_buffer"].to_local(), resumed_opt.state[q]["momentum_buffer"].to_local())
    return saved
