"""`whole_block_placement`: a `shard_placement_fn` for `fully_shard` that leaves every rank whole blocks.

[Note: Structure-aware placement]
A whole-matrix optimizer (whole_matrix.py) updates the independent blocks (`independent_block`) a
rank's piece holds whole where they lie, and sends to an owner (and the update back) only the runs
of blocks that a cut between two ranks' pieces crosses. A placement with no such cut sends nothing.
FSDP2's `fully_shard` already lets the user pick each parameter's shard dim (`shard_placement_fn`
returning `Shard(dim)`), and the pieces along a dim are fixed by that choice (`torch.chunk`'s split:
ceil(size / W) per rank). So the placement that keeps structure is a choice of dim, per parameter:
the first dim, from 0 up, whose cuts between ranks all fall on block edges. Where none does,
`Shard(0)` (FSDP2's default) stays and that parameter's crossed runs take the owner path. Nothing
else changes: parameters stay `Shard(k)` DTensors, so state dicts, DCP and torch's own
`fully_shard` take the same `shard_placement_fn`.

What it gives, by block shape:
- Muon on a stack of matrices [E, M, N] (block [1, M, N]): dim 0, always (FSDP2's default already).
- Muon on a plain [M, N] matrix (block [M, N]): no dim, unless one rank's chunk covers the whole dim
  (M = 1, or one rank): per-parameter `Shard(k)` cannot give one rank a whole 2-D matrix.
- A block-wise preconditioner with b x b blocks: dim 0 where ceil(M / W) is a multiple of b, else
  dim 1 where ceil(N / W) is: e.g. a [341, 128] SwiGLU weight on 2 ranks with b = 32 is cut at row
  171 under `Shard(0)` but at column 64 under `Shard(1)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

import torch
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, Shard

from .owners import pieces_hold_whole_blocks

BlockShape = Union[Sequence[int], Callable[[torch.Size], Sequence[int]]]


def whole_block_placement(block: BlockShape, mesh: DeviceMesh | int) -> Callable[[nn.Parameter], Shard | None]:
    """A `shard_placement_fn` for `fully_shard(..., mesh=mesh)` under which every rank holds whole blocks.

    Args:
        block: the shape of the blocks the optimizer updates independently. A sequence of sizes for
            the trailing dims (leading dims count one entry per block: `(b, b)` tiles every matrix of
            a stack), or a callable from a parameter's shape to its block shape (all dims), e.g.
            `lambda shape: (1,) * (len(shape) - 2) + tuple(shape[-2:])` for one matrix per block (Muon).
            Parameters with fewer dims than a sequence `block` (norms, biases) keep `Shard(0)`.
        mesh: the mesh `fully_shard` will use (its last axis shards; HSDP's first replicates), or its
            number of shards.

    Returns:
        A function giving, per parameter, `Shard(dim)` for the first dim (from 0) whose cuts between
        ranks all fall on block edges, or None (FSDP2's default, `Shard(0)`) where no dim does: the
        blocks its cuts cross then travel to an owner each step.
    """
    num_shards = _num_shards(mesh)
    block_of = _block_fn(block)

    def placement(param: nn.Parameter) -> Shard | None:
        shape = param.shape
        block_shape = block_of(shape)
        if block_shape is None:  # fewer dims than the block (norms, biases): not the optimizer's
            return None
        block_shape = tuple(block_shape)
        if len(block_shape) != len(shape):
            raise ValueError(
                f"the block shape {block_shape} for a parameter of shape {tuple(shape)} has {len(block_shape)} "
                f"dims; return one size per dim of the parameter"
            )
        for dim in range(len(shape)):
            if pieces_hold_whole_blocks(shape, dim, num_shards, block_shape):
                return Shard(dim)
        return None

    return placement


def _num_shards(mesh: DeviceMesh | int) -> int:
    if isinstance(mesh, DeviceMesh):
        return mesh.size(mesh.ndim - 1)
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        if mesh < 1:
            raise ValueError(f"the number of shards must be at least 1; got {mesh}")
        return mesh
    raise TypeError(f"mesh must be the DeviceMesh fully_shard will use or a positive number of shards; got {mesh!r}")


def _block_fn(block: BlockShape) -> Callable[[torch.Size], Sequence[int] | None]:
    if callable(block):
        return block
    sizes = tuple(block) if isinstance(block, Sequence) else None
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes):
        raise ValueError(
            f"block must be positive block sizes for the trailing dims, e.g. (128, 128), or a callable from a "
            f"parameter's shape to its block shape; got {block!r}"
        )

    def trailing(shape: torch.Size) -> tuple[int, ...] | None:
        if len(shape) < len(sizes):
            return None
        return (1,) * (len(shape) - len(sizes)) + sizes

    return trailing
