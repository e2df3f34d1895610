"""Eager runtime: training matches a single-process unsharded model on the same global batch."""

import pytest
import torch

from _harness import run_ranks
from _models import MLPStack, shard_blocks_then_root, shard_llama, tiny_llama, train_and_compare
from fsdp_graph import fully_shard


def _shard_mlp(model, **kwargs):
    shard_blocks_then_root(model, **kwargs)
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


def _hsdp_parity(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    return train_and_compare(tiny_llama(), lambda m: shard_llama(m, fully_shard, mesh=mesh), rank, world_size)


def test_hsdp_2x2_matches_unsharded():
    run_ranks(_hsdp_parity, 4)


def _debug_log_names(rank, world_size):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("fsdp_graph")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    model = shard_llama(tiny_llama(), fully_shard)
    with torch.profiler.profile() as prof:
        model(torch.randint(0, 64, (2, 8))).sum().backward()
    ranges = {e.name for e in prof.events()}
    return records, sorted(r for r in ranges if r.startswith("fsdp_graph::"))


def test_debug_logs_use_profiler_range_names():
    records, ranges = run_ranks(_debug_log_names, 2)
    for name in ["fsdp_graph::pre_forward (layers.0)", "fsdp_graph::post_backward (layers.1)",
                 "fsdp_graph::pre_backward (<root>)", "fsdp_graph::all_gather (layers.1)"]:
        assert any(r == name or r.startswith(name + " ") for r in records), (name, records)
        assert name in ranges, (name, ranges)
