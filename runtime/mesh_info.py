"""The mesh a group is sharded over, read once: sizes, ranks and process groups of its axes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, Shard


def parallelism_name(group: dist.ProcessGroup) -> str:
    """What a process group is called where a wire order names a collective that is not FSDP's: the
    DeviceMesh dim it spans ("tp"), or else its name."""
    desc = group.group_desc
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else group.group_name


@dataclass(frozen=True)
class MeshInfo:
    """The mesh a group is sharded over and the ranks that play each role in it.

    `shard_axis` is the mesh axis parameters are sharded on; on a 2-D (HSDP) mesh axis 0 replicates.
    Sizes, ranks and group names are read from the mesh once, here: traced hooks read them as plain
    values, so Dynamo guards on a few ints and strings instead of on the mesh's internals (fewer
    guards to rebuild when `fsdp_graph.precompile` loads a saved step).
    """

    mesh: DeviceMesh
    is_hsdp: bool = field(init=False)
    shard_axis: int = field(init=False)
    shard_size: int = field(init=False)
    shard_rank: int = field(init=False)
    replicate_size: int = field(init=False)
    shard_group_name: str = field(init=False)
    replicate_group_name: str | None = field(init=False)  # HSDP only
    ranks: tuple[int, ...] = field(init=False)  # every rank of the mesh, ascending

    def __post_init__(self) -> None:
        mesh = self.mesh
        is_hsdp = mesh.ndim == 2
        shard_axis = mesh.ndim - 1
        values = {
            "is_hsdp": is_hsdp,
            "shard_axis": shard_axis,
            "shard_size": mesh.size(shard_axis),
            "shard_rank": mesh.get_local_rank(shard_axis),
            "replicate_size": mesh.size(0) if is_hsdp else 1,
            "shard_group_name": mesh.get_group(shard_axis).group_name,
            "replicate_group_name": mesh.get_group(0).group_name if is_hsdp else None,
            "ranks": tuple(sorted(mesh.mesh.flatten().tolist())),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    @property
    def shard_group(self):
        return self.mesh.get_group(self.shard_axis)

    @property
    def replicate_group(self):
        return self.mesh.get_group(0) if self.is_hsdp else None

    def parallelism_names(self) -> frozenset[str]:
        """`parallelism_name` of each process group the group's collectives run on."""
        groups = [self.shard_group] + ([self.replicate_group] if self.is_hsdp else [])
        return frozenset(parallelism_name(g) for g in groups)

    def shard_rows_of_every_rank(self) -> list[list[int]]:
        """The global ranks of every shard group like this one, this rank's among them, each in
        shard-rank order. A mesh sliced from a larger one (`mesh["dp"]` beside "tp", the
        data-parallel ranks left after expert parallelism) holds only the rows this rank is in,
        yet a `new_group` over a part of a row is collective over every rank, which must all make
        the same groups in the same order: the rows come from the root mesh's layout."""
        mesh = self.mesh
        layout, rank_map = getattr(mesh, "_layout", None), getattr(mesh, "_rank_map", None)
        whole = mesh.mesh if layout is None or rank_map is None else layout.remap_to_tensor(rank_map)
        return whole.reshape(-1, self.shard_size).tolist()

    def placements(self, shard_dim: int = 0) -> tuple:
        return (Replicate(), Shard(shard_dim)) if self.is_hsdp else (Shard(shard_dim),)
