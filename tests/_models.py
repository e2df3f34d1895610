"""Models, data and the unsharded reference shared by the tests."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import Block, Llama, LlamaConfig, shard_llama  # noqa: E402

__all__ = [
    "Block", "Llama", "LlamaConfig", "MLPStack", "shard_blocks_then_root", "shard_llama", "tiny_llama",
    "Boom", "backward_on_both", "batch_for_step", "check_grads_match", "comm_counts", "paired_llama", "check_params_match", "global_mean",
]


def shard_blocks_then_root(model: nn.Module, fully_shard=None, **kwargs) -> nn.Module:
    """The usual order: each block (`model.blocks`, else `model.layers`) a group of its own, then the
    root with what is left; `kwargs` go to every call. `fully_shard`: ours unless given (torch's,
    for a reference)."""
    if fully_shard is None:
        from fsdp_graph import fully_shard
    for block in model.blocks if hasattr(model, "blocks") else model.layers:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class MLPStack(nn.Module):
    """Blocks of uneven widths (dim 0 of 5, 13 and 1 do not divide by 2 or 4) and a head; `block(dim,
    hidden)` makes each block (`MLPBlock` unless given)."""

    def __init__(self, dim: int = 13, hidden: int = 5, num_blocks: int = 3, block: "type | None" = None) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList((block or MLPBlock)(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def tiny_llama(num_layers: int = 2) -> Llama:
    return Llama(LlamaConfig(vocab_size=64, dim=32, num_layers=num_layers, num_heads=2, hidden_dim=56))


def batch_for_step(model: nn.Module, step: int, global_batch: int, rank: int, world_size: int):
    """(global inputs, global targets, this rank's slice of both); the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    if isinstance(model, Llama) or isinstance(getattr(model, "cfg", None), LlamaConfig):  # tokens
        seq = 8
        tokens = torch.randint(0, model.cfg.vocab_size, (global_batch, seq + 1), generator=gen)
        x, y = tokens[:, :-1], tokens[:, 1:]
    else:
        x = torch.randn(global_batch, model.inp.weight.shape[1], generator=gen)
        y = torch.randn(global_batch, generator=gen)
    per_rank = global_batch // world_size
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    return x, y, x[local], y[local]


def loss_fn(model: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, Llama) or out.dim() == 3:
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(out, y)


def paired_llama(**shard_kwargs):
    """(model, unsharded reference copy, sharded copy) of a seeded tiny Llama."""
    torch.manual_seed(0)
    model = tiny_llama()
    return model, copy.deepcopy(model), shard_llama(copy.deepcopy(model), _fully_shard(), **shard_kwargs)


def backward_on_both(reference: nn.Module, sharded: nn.Module, step: int, rank: int, world_size: int):
    """One backward of step `step`'s global batch on `reference` and this rank's slice on `sharded`;
    returns the slice (inputs, targets)."""
    x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
    loss_fn(reference, reference(x), y).backward()
    loss_fn(sharded, sharded(lx), ly).backward()
    return lx, ly


class Boom(nn.Module):
    """A linear layer whose forward raises once `fail` is set (user code that throws)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        if self.fail:
            raise RuntimeError("user error in forward")
        return x


def _fully_shard():
    from fsdp_graph import fully_shard

    return fully_shard


def comm_counts(mode) -> dict[str, int]:
    """Collectives a `CommDebugMode` saw, by short op name (e.g. '_allgather_base_')."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def check_grads_match(sharded: nn.Module, reference: nn.Module, rtol=1e-5, atol=1e-6) -> int:
    """Every sharded gradient equals the matching shard of the reference gradient; returns the count."""
    ref = dict(reference.named_parameters())
    num = 0
    for name, p in sharded.named_parameters():
        r = ref[name]
        if r.grad is None:
            assert p.grad is None, f"{name}: reference has no grad but sharded does"
            continue
        assert p.grad is not None, f"{name}: sharded grad missing"
        if isinstance(p, DTensor):
            assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
            expected = distribute_tensor(r.grad.detach(), p.device_mesh, p.placements).to_local()
        else:
            expected = r.grad
        torch.testing.assert_close(_local(p.grad), expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        num += 1
    return num


def check_params_match(sharded: nn.Module, reference: nn.Module, rtol=1e-5, atol=1e-6) -> None:
    ref = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        if isinstance(p, DTensor):
            expected = distribute_tensor(ref[name].detach(), p.device_mesh, p.placements).to_local()
        else:
            expected = ref[name].detach()
        torch.testing.assert_close(_local(p).detach(), expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def train_and_compare(
    model: nn.Module, shard, rank: int, world_size: int, steps: int = 5, global_batch: int = 8,
    rtol: float = 1e-5, compare_grads: bool = True, lr: float = 1e-2, before_forward=None,
) -> list[float]:
    """Train `shard(copy of model)` and an unsharded copy on the same global batch; compare every step.

    Returns the sharded run's global losses.
    """
    reference = copy.deepcopy(model)
    sharded = shard(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    opt = torch.optim.AdamW(sharded.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y, lx, ly = batch_for_step(model, step, global_batch, rank, world_size)
        ref_loss = loss_fn(reference, reference(x), y)
        ref_loss.backward()
        if before_forward is not None:
            before_forward(sharded)
        loss = loss_fn(sharded, sharded(lx), ly)
        loss.backward()
        got = global_mean(loss)
        assert abs(got - ref_loss.item()) <= rtol * abs(ref_loss.item()) + 1e-7, (
            f"step {step}: loss {got} != reference {ref_loss.item()}"
        )
        if compare_grads:
            check_grads_match(sharded, reference)
        losses.append(got)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    # AdamW divides by the gradient's running RMS, so entries whose gradients are ~1e-7 (where the
    # gradient check's atol dominates) can move by a visible fraction of lr: compare at 1e-5.
    check_params_match(sharded, reference, atol=1e-5)
    return losses
