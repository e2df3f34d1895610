"""torch's composable `replicate` around a model whose blocks `fully_shard` sharded (DDP outside,
FSDP inside): replicate must leave the sharded blocks alone and all-reduce only the rest. Against
torch's `fully_shard` composed the same way and the unsharded model on the global batch."""

import copy

import torch
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from _harness import run_ranks
from _models import batch_for_step, check_grads_match, check_params_match, global_mean, loss_fn
from fsdp_graph import fully_shard


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)  # batch_for_step reads inp.weight's width
        self.blocks = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6))
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        return self.head(torch.relu(self.blocks(self.inp(x)))).squeeze(-1)


def _compose(model, shard):
    shard(model.blocks[0])
    shard(model.blocks[2])
    return replicate(model)


def _train(rank, world_size):
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    ours, theirs = _compose(copy.deepcopy(model), fully_shard), _compose(copy.deepcopy(model), torch_fully_shard)
    nets = (reference, ours, theirs)
    opts = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in nets]
    for step in range(3):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        expected = loss_fn(reference, reference(x), y)
        expected.backward()
        for net in (ours, theirs):
            loss = loss_fn(net, net(lx), ly)
            loss.backward()
            torch.testing.assert_close(global_mean(loss), expected.item(), rtol=1e-5, atol=0)
            check_grads_match(net, reference)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for net in (ours, theirs):
        check_params_match(net, reference)
    sharded = [name for name, p in ours.named_parameters() if isinstance(p, DTensor)]
    return sharded, [name for name, p in theirs.named_parameters() if isinstance(p, DTensor)]


def test_replicate_around_fully_shard_blocks():
    """The blocks stay DTensor shards and train as torch's fully_shard + replicate; the replicated
    input and head layers match the unsharded model too."""
    ours, theirs = run_ranks(_train, 2)
    assert ours == theirs == ["blocks.0.weight", "blocks.0.bias", "blocks.2.weight", "blocks.2.bias"]
