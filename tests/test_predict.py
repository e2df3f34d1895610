"""fsdp_graph.predict: capturing a step at a world size and on parameters this process never holds.

The reference is arithmetic on the unsharded model's parameter shapes: what each group's forward
all-gather must carry at world size 64 (padded rows plus one gradient flag per trainable parameter
per rank, see [Note: Gradient flags in a graph] in runtime/traced.py), and one reduce-scatter per
group in backward.
"""

import math

import pytest
import torch
import torch.distributed as dist

from _models import MLPStack
from fsdp_graph import fully_shard
from fsdp_graph.passes.nodes import fsdp_meta, is_all_gather, is_reduce_scatter, tensor_bytes
from fsdp_graph.predict import capture_graphs, fake_world
from fsdp_graph.runtime.meta import GROUP_KEY

WORLD = 64


def _expected_gather_bytes(params: list) -> int:
    per_rank = sum(math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:]) + 1 for p in params)
    return WORLD * per_rank * 4  # fp32


def test_capture_on_meta_at_world_size_64():
    with torch.device("meta"):
        model = MLPStack()
    groups = {f"blocks.{i}": list(block.parameters()) for i, block in enumerate(model.blocks)}
    groups["<root>"] = [*model.inp.parameters(), *model.head.parameters()]
    with fake_world(WORLD):
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        graphs = capture_graphs(model, torch.randn(4, 13, device="meta"))
    gathered = {fsdp_meta(n, GROUP_KEY): tensor_bytes(n) for n in graphs["forward"].graph.nodes if is_all_gather(n)}
    assert gathered == {group: _expected_gather_bytes(params) for group, params in groups.items()}
    reduced = [fsdp_meta(n, GROUP_KEY) for n in graphs["backward"].graph.nodes if is_reduce_scatter(n)]
    assert sorted(reduced) == sorted(groups)
    assert not dist.is_initialized()  # fake_world cleaned up


def test_fake_world_refuses_a_second_process_group():
    with fake_world(2):
        with pytest.raises(ValueError, match="destroy_process_group"):
            with fake_world(4):
                pass
