"""Modules Dynamo does not trace fall back to the eager hooks, with the same numbers, and are reported.

Two gloo ranks. Block 1 has a graph break inside its forward and block 2's forward is wrapped in
`torch.compiler.disable`; the other groups are gathered inside graphs. Every gradient must match the
unsharded reference and (aot_eager) the eager runtime bit for bit: a group gathered on both paths
or reduced twice, or left unreduced, would show up there.
"""

import tempfile

import torch

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import MLPBlock, MLPStack, shard_blocks_then_root
from fsdp_graph.inspect.dump import load_summary


class BlockWithGraphBreak(MLPBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(hidden)


def _shard(model):
    model.blocks[1].__class__ = BlockWithGraphBreak
    model.blocks[2].forward = torch.compiler.disable(model.blocks[2].forward)
    shard_blocks_then_root(model)
    return model


def _train(rank, world_size):
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as dump_dir:
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=dump_dir)
        result = train_compiled_and_compare(MLPStack(num_blocks=4), _shard, backend, rank, world_size)
        result["summary"] = load_summary(dump_dir)
    return result


def test_graph_break_and_disabled_module_fall_back_with_parity():
    result = run_ranks(_train, 2)
    fallbacks = result["fallbacks"]
    assert {"blocks.1", "blocks.2"} <= set(fallbacks), fallbacks
    # A break inside the blocks' loop stops the root's own frame, so the root group falls back too.
    assert "<root>" in fallbacks, fallbacks
    assert all("eager runtime's hooks" in reason for reason in fallbacks.values())
    # The dump names the same modules, and some group was still gathered inside a graph: the two
    # paths met in the same step.
    summary = result["summary"]
    assert summary["fallbacks"] == fallbacks
    traced = {
        c["group"]
        for graphs in summary["graphs"].values()
        for c in graphs.get("forward", {}).get("collectives", [])
        if c["op"] == "all_gather_into_tensor"
    }
    assert traced and not traced & {"blocks.1", "blocks.2"}, traced


def _shard_two_breaking_blocks(model):
    for i in (1, 2):  # two blocks of one kind, both breaking the graph
        model.blocks[i].__class__ = BlockWithGraphBreak
    shard_blocks_then_root(model)
    return model


def _train_with_every_block_a_region(rank, world_size):
    torch.manual_seed(0)
    backend = fsdp_graph.backend(compiler="aot_eager", regions="blocks")
    return train_compiled_and_compare(MLPStack(num_blocks=4), _shard_two_breaking_blocks, backend, rank, world_size)


def test_blocks_that_break_the_graph_fall_back_under_every_block_regions():
    # regions="blocks" traces the first block of each kind inline, so a block that breaks the graph
    # breaks it there (Dynamo refuses a break inside a region) and falls back as without regions,
    # and so does the next block of its kind ([Note: Every block a compile region]).
    result = run_ranks(_train_with_every_block_a_region, 2)
    assert {"blocks.1", "blocks.2"} <= set(result["fallbacks"]), result["fallbacks"]
