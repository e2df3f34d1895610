"""Capture the partitioned forward and backward graphs of one compiled step, for the pass tests."""

from __future__ import annotations
from _models import shard_blocks_then_root


import torch
import torch.nn as nn

from fsdp_graph import fully_shard
from fsdp_graph.passes.cost_model import CostModel, HardwareProfile
from fsdp_graph.predict import capture_graphs  # noqa: F401 (the pass tests import it from here)

# A fixed machine for the pass tests: 1 GFLOP/s, 1 GB/s memory, 10 us + 1 B/ns collectives.
FIXED = CostModel(HardwareProfile("fixed", 1e9, 1e9, 1e9, 0.0, 10e-6, 1e9))
# The same machine with collectives that cost only latency (every bucket is latency-bound).
LATENCY_BOUND = CostModel(HardwareProfile("latency-bound", 1e9, 1e9, 1e9, 0.0, 1e-3, 1e15))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Three blocks and a head; each block is one fully_shard group, the head is in the root's."""

    def __init__(self, dim: int = 16, num_blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_stack(**kwargs) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    shard_blocks_then_root(model, **kwargs)
    return model


class EmbedStack(nn.Module):
    """Two blocks between an embedding and an output layer, both in the root's group: the root's
    bucket is the largest, and its embedding gradient is the backward's last."""

    def __init__(self, vocab: int = 256, dim: int = 16, num_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_embed_stack() -> EmbedStack:
    torch.manual_seed(0)
    model = EmbedStack()
    shard_blocks_then_root(model)
    return model


def tensor_parallel_stack(mesh) -> Stack:
    """`Stack` with each block's up colwise and down rowwise over mesh["tp"], then sharded over
    mesh["dp"]: the forward holds one tp all-reduce per block (down's output), the backward one
    per block for the input gradient of up."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Stack()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def schedule_lines(gm: torch.fx.GraphModule) -> str:
    """Collectives, waits and matmuls in graph order: `AG blocks.0`, `wait AG blocks.0`, `mm`."""
    from fsdp_graph.passes.nodes import collective_label, collective_of, is_all_gather, is_all_reduce, is_collective, is_wait_tensor

    def short(node):
        kind = "AG " if is_all_gather(node) else "AR " if is_all_reduce(node) else "RS "
        return kind + collective_label(node)

    lines = []
    for node in gm.graph.nodes:
        if is_collective(node):
            lines.append(short(node))
        elif is_wait_tensor(node) and collective_of(node) is not None:
            lines.append("wait " + short(collective_of(node)))
        elif node.op == "call_function" and node.target is torch.ops.aten.mm.default:
            lines.append("mm")
    return "\n".join(lines)
