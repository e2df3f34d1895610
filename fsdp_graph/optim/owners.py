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
    """

    mesh: DeviceMesh
    shard_dim: int
    shape: torch.Size

    @property
    def num_shards(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def num_replicas(self) -> int:
        return self.mesh.size(0) if self.mesh.ndim == 2 else 1

    def piece_shape(self, shard_index: int) -> torch.Size:
        """The shape of the piece shard `shard_index` holds (the same on every replica)."""
        shape = list(self.shape)
        shape[self.shard_dim] = chunk_sizes(self.shape[self.shard_dim], self.num_shards)[shard_index]
        return torch.Size(shape)

    def holds_whole_blocks(self, block: Sequence[int]) -> bool:
        """Whether every shard's piece is made of whole blocks of shape `block`."""
        return pieces_hold_whole_blocks(self.shape, self.shard_dim, self.num_shards, block)

    def split(self, whole: torch.Tensor) -> list[torch.Tensor]:
        """`whole` cut into the pieces of shards 0, 1, ... (views)."""
        sizes = chunk_sizes(self.shape[self.shard_dim], self.num_shards)
        return list(torch.split(whole, sizes, dim=self.shard_dim))


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
