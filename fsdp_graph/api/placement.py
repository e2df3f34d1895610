"""What `shard_placement_fn` says of each parameter: the dim it shards on and the mesh it shards over.

FSDP2's `shard_placement_fn` returns, per parameter, None (dim 0 over fully_shard's mesh), a
`Shard(dim)` (over fully_shard's mesh), or a `ShardPlacementResult`: a placement (None or
`Shard(dim)`) and a `mesh_info` naming a mesh of the parameter's own, as expert parallelism does
for the expert weights ([Note: A group on several meshes] in runtime/multi_mesh_group.py).
Torch's `ShardPlacementResult` and `FSDPMeshInfo` are read by their fields (`placement`,
`mesh_info`; `mesh`, `shard_mesh_dim`, `replicate_mesh_dim`), so that fsdp_graph never imports
torch's FSDP; our `MeshInfo` is taken as `mesh_info` too.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from ..runtime.mesh_info import MeshInfo


def resolve_placements(
    shard_placement_fn: Optional[Callable], owners, mesh_info: MeshInfo, spmd: bool = False
) -> list[tuple[object, MeshInfo]]:
    """Per parameter of `owners` (param, owners, fqn): what `shard_placement_fn` returned as its
    placement (checked later by `shard_dim`) and the `MeshInfo` it shards over. Parameters on meshes
    with the same process groups get the same `MeshInfo`; `mesh_info` is fully_shard's.
    `spmd`: fully_shard got `dp_mesh_dims`, where a mesh of a parameter's own is refused."""
    infos = {_key(mesh_info): mesh_info}
    resolved = []
    for param, _, fqn in owners:
        result = None if shard_placement_fn is None else shard_placement_fn(param)
        if not (hasattr(result, "placement") and hasattr(result, "mesh_info")):
            resolved.append((result, mesh_info))
            continue
        info = _own_mesh_info(result.mesh_info, fqn, mesh_info)
        info = infos.setdefault(_key(info), info)
        if spmd and info is not mesh_info:
            raise ValueError(
                f"shard_placement_fn gave '{fqn}' a mesh of its own ({info.mesh}), which fsdp_graph does not "
                f"combine with dp_mesh_dims; shard it over fully_shard's mesh (return a Shard or None)"
            )
        resolved.append((result.placement, info))
    return resolved


def _key(info: MeshInfo) -> tuple:
    return (info.shard_group_name, info.replicate_group_name)


def _own_mesh_info(given, fqn: str, default: MeshInfo) -> MeshInfo:
    """A `ShardPlacementResult`'s `mesh_info` (torch's `FSDPMeshInfo` / `HSDPMeshInfo`, or ours) as
    our `MeshInfo`: a 1-D mesh sharding on axis 0, or a 2-D one replicating on 0, sharding on 1."""
    if isinstance(given, MeshInfo):
        return given
    where = f"shard_placement_fn's ShardPlacementResult for '{fqn}'"
    mesh = getattr(given, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where} has mesh_info={given!r}; pass an FSDPMeshInfo(mesh=..., shard_mesh_dim=0) whose mesh "
            f"is a DeviceMesh"
        )
    axes = (getattr(given, "replicate_mesh_dim", None), getattr(given, "shard_mesh_dim", None))
    expected = {1: (None, 0), 2: (0, 1)}.get(mesh.ndim)
    if axes != expected or getattr(given, "dp_mesh_dims", None) is not None:
        raise ValueError(
            f"{where} shards over {mesh} with (replicate_mesh_dim, shard_mesh_dim) = {axes}; fsdp_graph "
            f"takes a 1-D mesh with shard_mesh_dim=0, or a 2-D one with replicate_mesh_dim=0, "
            f"shard_mesh_dim=1 (HSDPMeshInfo), without dp_mesh_dims"
        )
    if mesh.device_type != default.mesh.device_type:
        raise ValueError(
            f"{where} shards over a {mesh.device_type} mesh, but fully_shard's mesh is "
            f"{default.mesh.device_type}; build both meshes on one device type"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"{where} shards over {mesh}, which does not include this rank; every rank must name a mesh "
            f"that contains it (e.g. its slice of the expert-parallel mesh)"
        )
    return MeshInfo(mesh)


def shard_dim(placement, param: nn.Parameter, fqn: str) -> int:
    """The dim `placement` (from `shard_placement_fn`) shards `param` on, negative dims counting
    from the end; 0 for None."""
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for '{fqn}'; fsdp_graph shards every parameter: "
            f"return Shard(dim) for a dim of the parameter, None for Shard(0), or a ShardPlacementResult"
        )
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned {placement} for '{fqn}', which has {param.ndim} dims; return "
            f"Shard(dim) with -{param.ndim} <= dim < {param.ndim}"
        )
    return dim
