"""Uneven dim-0 sizes (smaller than the world too) and 1-D parameters, at world sizes 2 and 4."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from _harness import run_ranks
from _models import train_and_compare
from fsdp_graph import fully_shard


class Uneven(nn.Module):
    """Linear layers whose weights have 1, 3 and 5 rows, biases as 1-D parameters, and a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)  # weight (5, 6), bias (5,)
        self.mid = nn.Linear(5, 3)  # weight (3, 5), bias (3,)
        self.out = nn.Linear(3, 1)  # weight (1, 3), bias (1,)
        self.scale = nn.Parameter(torch.ones(7))

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(h).squeeze(-1) * self.scale.sum()


def _shard(model):
    fully_shard(model.mid)
    fully_shard(model)
    return model


def _uneven(rank, world_size):
    torch.manual_seed(0)
    model = Uneven()
    sharded = _shard(Uneven())
    for name, p in sharded.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), name
        assert p.shape == dict(model.named_parameters())[name].shape, name
        chunks = torch.chunk(torch.empty(p.shape[0]), world_size)  # DTensor's own split rule
        expected_rows = chunks[rank].shape[0] if rank < len(chunks) else 0
        assert p.to_local().shape[0] == expected_rows, (name, p.to_local().shape)
    train_and_compare(model, _shard, rank, world_size, global_batch=8)


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_and_1d_parameters(world_size):
    run_ranks(_uneven, world_size)
