"""Who owns which matrix, and where each rank's piece of it lies: the plan a whole-matrix step follows.

Everything here is computed from global shapes, mesh sizes and costs only, so every rank derives the
same plan without communicating. See [Note: Whole-matrix updates on sharded parameters] in
whole_matrix.py for how the plan is used.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard


def chunk_sizes(dim_size: int, num_chunks: int) -> list[int]:
    """How many entries of a dim of `dim_size` each of `num_chunks` ranks holds under `Shard`.

    `torch.chunk`'s split, which is what DTensor's `Shard` (and the runtime's padding layout in
    runtime/param.py) means for uneven sizes: ceil(dim_size / num_chunks) per rank, the last ones
    shorter or empty.
    """
    padded = math.ceil(dim_size / num_chunks) if dim_size else 0
    return [max(0, min(padded, dim_size - i * padded)) for i in range(num_chunks)]


def pieces_hold_whole_blocks(shape: Sequence[int], shard_dim: int, num_shards: int, block: Sequence[int]) -> bool:
    """Whether sharding `shape` on `shard_dim` over `num_shards` ranks leaves every rank whole blocks.

    `block` is the shape of the independent blocks (one size per dim of `shape`; blocks tile the
    tensor from index 0, the last ones along a dim cut short by its end). Every rank's piece is made of
    whole blocks exactly when every cut between two ranks' pieces falls on a block edge.
    """
    size, block_size = shape[shard_dim], max(1, block[shard_dim])
    cuts = itertools.accumulate(chunk_sizes(size, num_shards))
    return all(cut % block_size == 0 or cut == size for cut in cuts)


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is laid out over its mesh.

    Attributes:
        mesh: the parameter's mesh: 1-D (sharded on its only axis) or 2-D (HSDP: replicated on
            axis 0, sharded on axis 1).
        shard_dim: the tensor dim the shard axis splits.
        shape: the global shape.
        sizes: each shard's length along `shard_dim`; None for `Shard`'s (`chunk_sizes`). A run of
            blocks cut out of a parameter (`shared_blocks`) has its own.
    """

    mesh: DeviceMesh
    shard_dim: int
    shape: torch.Size
    sizes: tuple[int, ...] | None = None

    @property
    def num_shards(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def num_replicas(self) -> int:
        return self.mesh.size(0) if self.mesh.ndim == 2 else 1

    @property
    def piece_sizes(self) -> tuple[int, ...]:
        return self.sizes if self.sizes is not None else tuple(chunk_sizes(self.shape[self.shard_dim], self.num_shards))

    def piece_shape(self, shard_index: int) -> torch.Size:
        """The shape of the piece shard `shard_index` holds (the same on every replica)."""
        shape = list(self.shape)
        shape[self.shard_dim] = self.piece_sizes[shard_index]
        return torch.Size(shape)

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """`whole` cut into the pieces of shards 0, 1, ... (views)."""
        return list(torch.split(whole, self.piece_sizes, dim=self.shard_dim))


@dataclass(frozen=True)
class SharedBlocks:
    """One block's run along a parameter's shard dim that a cut between two pieces crosses: it is
    updated as one matrix on an owner (its layout: its shape and each shard's part of it).

    Attributes:
        layout: the run as a matrix of its own, sharded as the parameter is.
        offset: where this rank's part of the run starts inside this rank's piece (along the shard dim).
    """

    layout: ShardLayout
    offset: int


def block_parts(
    layout: ShardLayout, block: Sequence[int], shard_index: int
) -> tuple[tuple[int, int], list[SharedBlocks]]:
    """Cut one parameter by its independent blocks (`block`, one size per dim): (the range, inside
    shard `shard_index`'s piece along the shard dim, of the whole blocks that piece holds alone; and
    the runs of blocks that cuts between pieces cross, in order along the dim).

    Blocks tile the parameter from index 0. A cut on a block edge crosses nothing; any other cut
    crosses the one block run [c - c % b, c - c % b + b) (shortened at the end of the dim), which
    several cuts may share. With one block spanning the whole dim (Muon's matrices), every cut
    crosses it and the run is the whole parameter.
    """
    dim, size = layout.shard_dim, layout.shape[layout.shard_dim]
    b = max(1, block[dim])
    sizes = layout.piece_sizes
    starts = [0, *itertools.accumulate(sizes)][:-1]
    cut_blocks = sorted({c - c % b for c in itertools.accumulate(sizes) if 0 < c < size and c % b})
    shared = []
    for first in cut_blocks:
        last = min(first + b, size)
        run_sizes = tuple(max(0, min(s + n, last) - max(s, first)) for s, n in zip(starts, sizes))
        shape = list(layout.shape)
        shape[dim] = last - first
        lo = starts[shard_index]
        offset = max(lo, first) - lo if run_sizes[shard_index] else 0
        shared.append(SharedBlocks(ShardLayout(layout.mesh, dim, torch.Size(shape), run_sizes), offset))
    lo, hi = starts[shard_index], starts[shard_index] + sizes[shard_index]
    alone_lo = lo if lo % b == 0 else min(hi, lo - lo % b + b)
    alone_hi = hi if hi % b == 0 or hi == size else max(alone_lo, hi - hi % b)
    return (alone_lo - lo, alone_hi - lo), shared


def shard_layout(param: torch.Tensor) -> ShardLayout | None:
    """The layout of a `fully_shard`-ed parameter, or None for a plain (unsharded) tensor.

    Raises a `ValueError` for DTensor layouts a whole-matrix step cannot rebuild: anything but
    `(Shard(k),)` on a 1-D mesh or `(Replicate(), Shard(k))` on a 2-D one (e.g. tensor parallel).
    """
    if not isinstance(param, DTensor):
        return None
    placements = tuple(param.placements)
    mesh = param.device_mesh
    shard = placements[-1]
    replicated = all(type(p) is Replicate for p in placements[:-1])
    if mesh.ndim > 2 or type(shard) is not Shard or not replicated:
        raise ValueError(
            f"a whole-matrix optimizer needs parameters sharded as fully_shard shards them, (Shard(k),) "
            f"or (Replicate(), Shard(k)) for HSDP; got a parameter of shape {tuple(param.shape)} with "
            f"placements {placements} on a {mesh.ndim}-D mesh (e.g. tensor parallel): optimize it with "
            f"another optimizer"
        )
    return ShardLayout(mesh, shard.dim, param.shape)


def assign_owners(costs: list[float], num_ranks: int) -> list[int]:
    """Each matrix's owner: longest job first onto the least loaded rank (ties to the lower index).

    The guarantee: no rank's load exceeds sum(costs) / num_ranks plus the largest single cost, since
    every matrix goes to a rank whose load was at most the average when it arrived. Deterministic,
    so every rank computes the same owners.
    """
    owners = [0] * len(costs)
    loads = [(0.0, rank) for rank in range(num_ranks)]  # a heap of (load, rank)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + costs[index], rank))
    return owners


class MeshRanks:
    """The ranks of one mesh as a flat list, and the process group a whole-matrix step exchanges over.

    Flat index `replica * num_shards + shard` is the mesh's row-major order. A 1-D mesh exchanges over
    its own group; a 2-D (HSDP) mesh needs a group over all its ranks, which is the default group
    when the mesh covers the world, and otherwise a new group made here: then every rank of the world
    must build the optimizer (`dist.new_group` is collective over the world).
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.global_ranks = mesh.mesh.flatten().tolist()
        self.num_shards = mesh.size(mesh.ndim - 1)
        if mesh.ndim == 1:
            self.group = mesh.get_group(0)
        elif sorted(self.global_ranks) == list(range(dist.get_world_size())):
            self.group = dist.group.WORLD
        else:
            self.group = dist.new_group(sorted(self.global_ranks))
        # flat index -> rank in `group` (a group numbers its ranks in ascending global order).
        self.group_rank = [dist.get_group_rank(self.group, r) for r in self.global_ranks]
        me = mesh.get_coordinate()
        assert me is not None, "this rank is not in the mesh of a parameter it holds"
        self.my_replica = me[0] if mesh.ndim == 2 else 0
        self.my_shard = me[-1]
        self.my_index = self.my_replica * self.num_shards + self.my_shard

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    def replica_of(self, index: int) -> int:
        return index // self.num_shards

    def shard_of(self, index: int) -> int:
        return index % self.num_shards
