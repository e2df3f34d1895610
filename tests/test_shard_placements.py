"""`shard_placement_fn` returning `Shard(k)` for k > 0: experts `(E, d, h)` sharded on dim 1, Linear
weights on their input dim, eager and compiled (aot_eager).

Even sizes are checked against torch's `fully_shard` with the same placements (losses, every
gradient, final parameters); uneven sizes, which torch's FSDP2 refuses for k > 0, against the
unsharded model on the global batch (`train_and_compare` / `train_compiled_and_compare`).
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import batch_for_step, global_mean, loss_fn, train_and_compare
from fsdp_graph import fully_shard
from fsdp_graph.fsdp1.full_params import full_state_dict, load_full_state_dict, summon_full_params


class Experts(nn.Module):
    """Every token through every expert (dense), enough to give (E, d, h) weights real gradients."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, hidden, dim) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bd,edh->beh", x, self.w1).relu()
        return x + torch.einsum("beh,ehd->bd", h, self.w2) / self.w1.shape[0]


class ExpertNet(nn.Module):
    def __init__(self, in_dim: int, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.experts = Experts(num_experts, dim, hidden)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.experts(self.inp(x))).squeeze(-1)


def _experts_placement(param: nn.Parameter):
    return Shard(-2) if param.ndim == 3 else (Shard(1) if param.ndim == 2 else None)


def _shard(model: nn.Module, shard=fully_shard, **kwargs) -> nn.Module:
    shard(model.experts, shard_placement_fn=_experts_placement, **kwargs)
    shard(model, shard_placement_fn=_experts_placement, **kwargs)
    return model


EVEN = dict(in_dim=6, dim=8, hidden=6, num_experts=4)  # every dim 1 divisible by 2
UNEVEN = dict(in_dim=3, dim=5, hidden=7, num_experts=3)  # dim 1 of every matrix odd


def _against_torch(rank, world_size, reshard_after_forward):
    torch.manual_seed(0)
    model = ExpertNet(**EVEN)
    ours = _shard(copy.deepcopy(model), reshard_after_forward=reshard_after_forward)
    compiled_module = _shard(copy.deepcopy(model), reshard_after_forward=reshard_after_forward)
    compiled = torch.compile(compiled_module, backend=fsdp_graph.backend(compiler="aot_eager"))
    theirs = _shard(copy.deepcopy(model), torch_fully_shard, reshard_after_forward=reshard_after_forward)
    nets = {"eager": (ours, ours), "compiled": (compiled_module, compiled), "torch": (theirs, theirs)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, (m, _) in nets.items()}
    max_err = {"eager": 0.0, "compiled": 0.0}
    for step in range(3):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        losses = {}
        for key, (module, call) in nets.items():
            loss = loss_fn(module, call(x), y)
            loss.backward()
            losses[key] = global_mean(loss)
        theirs_params = dict(theirs.named_parameters())
        for key in ("eager", "compiled"):
            torch.testing.assert_close(losses[key], losses["torch"], rtol=1e-6, atol=0)
            for name, p in nets[key][0].named_parameters():
                q = theirs_params[name]
                assert p.placements == q.placements, name
                assert p.grad.placements == q.grad.placements, name
                diff = (p.grad.to_local() - q.grad.to_local()).abs()
                err = diff.max().item() if diff.numel() else 0.0
                max_err[key] = max(max_err[key], err)
                torch.testing.assert_close(p.grad.to_local(), q.grad.to_local(), rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{key} step {step} {name}: {m}")
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    for key in ("eager", "compiled"):
        for name, p in nets[key][0].named_parameters():
            torch.testing.assert_close(p.to_local(), theirs_params[name].to_local(), rtol=1e-5, atol=1e-6)
    assert not compiled_module._fsdp_state.ctx.fallbacks
    return max_err


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_shard_dim_1_same_as_torch_fully_shard(reshard_after_forward):
    max_err = run_ranks(_against_torch, 2, reshard_after_forward)
    print(f"max abs gradient error vs torch fully_shard: {max_err}")


def _uneven_eager(rank, world_size, reshard_after_forward):
    torch.manual_seed(0)
    model = ExpertNet(**UNEVEN)
    return train_and_compare(model, lambda m: _shard(m, reshard_after_forward=reshard_after_forward),
                             rank, world_size, steps=3)


@pytest.mark.parametrize("reshard_after_forward", [True, 2])
def test_uneven_shard_dim_1_matches_unsharded(reshard_after_forward):
    # 4 ranks: dim 1 of 3, 5 and 7 leaves some ranks one row, or none; 2 reshards to pairs after forward.
    run_ranks(_uneven_eager, 4, reshard_after_forward)


def _uneven_compiled(rank, world_size):
    torch.manual_seed(0)
    return train_compiled_and_compare(
        ExpertNet(**UNEVEN), _shard, fsdp_graph.backend(compiler="aot_eager"), rank, world_size,
    )


def test_uneven_shard_dim_1_compiled_matches_unsharded_and_eager_bitwise():
    result = run_ranks(_uneven_compiled, 2)
    assert not result["fallbacks"]
    print(f"max rel loss diff vs unsharded: {result['max_rel_diff_vs_reference']}")


def _state_dicts(rank, world_size):
    torch.manual_seed(0)
    model = ExpertNet(**UNEVEN)
    reference = copy.deepcopy(model)
    sharded = _shard(copy.deepcopy(model))
    state = sharded.state_dict()
    assert state["experts.w1"].placements == (Shard(1),)
    assert state["experts.w2"].placements == (Shard(1),)  # Shard(-2) of a 3-D parameter
    assert state["inp.weight"].placements == (Shard(1),) and state["inp.bias"].placements == (Shard(0),)
    for name, value in reference.state_dict().items():
        assert isinstance(state[name], DTensor)
        torch.testing.assert_close(state[name].full_tensor(), value)
    full = full_state_dict(sharded, rank0_only=False)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value)
    with summon_full_params(sharded, writeback=True):
        torch.testing.assert_close(sharded.experts.w1, reference.experts.w1)
        with torch.no_grad():
            sharded.experts.w1.add_(1.0)
    torch.testing.assert_close(sharded.state_dict()["experts.w1"].full_tensor(), reference.experts.w1 + 1.0)
    # Load the reference's weights back from rank 0, and a sharded state dict through load_state_dict.
    load_full_state_dict(sharded, reference.state_dict() if rank == 0 else None)
    torch.testing.assert_close(sharded.state_dict()["experts.w1"].full_tensor(), reference.experts.w1)
    other = _shard(ExpertNet(**UNEVEN))
    other.load_state_dict(sharded.state_dict())
    x, _, _, _ = batch_for_step(model, 0, 4, rank, world_size)
    torch.testing.assert_close(other(x), reference(x))


def test_state_dicts_of_shard_dim_1():
    run_ranks(_state_dicts, 2)
