"""Eager runtime: training matches a single-process unsharded model on the same global batch."""

import pytest
import torch

from _harness import run_ranks
from _models import MLPStack, shard_llama, tiny_llama, train_and_compare
from fsdp_graph import fully_shard


def _shard_mlp(model, **kwargs):
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _mlp_parity(rank, world_size, reshard_after_forward):
    torch.manual_seed(0)
    return train_and_compare(MLPStack(), lambda m: _shard_mlp(m, reshard_after_forward=reshard_after_forward), rank, world_size)


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_mlp_stack_matches_unsharded(reshard_after_forward):
    run_ranks(_mlp_parity, 2, reshard_after_forward)


def _llama_parity(rank, world_size):
    torch.manual_seed(0)
    return train_and_compare(tiny_llama(), lambda m: shard_llama(m, fully_shard), rank, world_size)


def test_transformer_matches_unsharded():
    run_ranks(_llama_parity, 2)
