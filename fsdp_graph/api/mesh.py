"""The mesh `fully_shard` shards over: the one it was given, checked, or one default mesh over the
default process group (initialised from torchrun's environment when there is none); with
`dp_mesh_dims`, the data-parallel axes of a whole SPMD mesh (`DataParallelMeshDims`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def _check_mesh(mesh: Optional[DeviceMesh], any_ndim: bool = False) -> DeviceMesh:
    """The mesh to shard over, checked; `any_ndim`: a whole SPMD mesh (`dp_mesh_dims`) of any rank."""
    if not dist.is_available():
        raise ValueError("fully_shard needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if mesh is not None:
            raise ValueError(
                "fully_shard got a mesh but no process group exists; call "
                "torch.distributed.init_process_group(...) before building the mesh"
            )
        # As FSDP2: the default process group from the environment (torchrun's RANK, WORLD_SIZE,
        # MASTER_ADDR, MASTER_PORT).
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"fully_shard needs a process group: none exists and the environment lacks {missing} to "
                f"make one; launch with torchrun, or call torch.distributed.init_process_group(...) first"
            )
        dist.init_process_group()
    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        return _default_mesh(device_type)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh must be a DeviceMesh, got {type(mesh).__name__}; build one with "
            f"torch.distributed.device_mesh.init_device_mesh(device_type, (world_size,))"
        )
    if mesh.ndim not in (1, 2) and not any_ndim:
        raise ValueError(
            f"mesh must be 1-D (FSDP) or 2-D (HSDP: replicate on axis 0, shard on axis 1), got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; slice it, e.g. mesh['dp']"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"mesh {mesh.mesh.tolist()} does not include this process (global rank "
            f"{dist.get_rank()} of {dist.get_world_size()}); every rank must call fully_shard with a "
            f"mesh that contains it, e.g. init_device_mesh(device_type, (world_size,))"
        )
    return mesh


# [Note: One default mesh]
# Every `fully_shard` call without `mesh=` shares one 1-D mesh over the default process group (per
# device type), as a script that builds one mesh and passes it to every call would. Separate but
# equal meshes work the same in eager mode, but a compiled graph takes each distinct mesh object its
# parameters hold as an opaque input, and whether two groups' parameters held one object or two
# depended on what the process had run before (torch shares equal DTensor specs): the same model
# gave graphs of different signatures (tests/test_compile_graphs.py failed when run alone). A new
# default group (after destroy_process_group and init_process_group) gets a new mesh.
_default_meshes: dict[str, tuple[Any, DeviceMesh]] = {}  # device type -> (default group, mesh)


def _default_mesh(device_type: str) -> DeviceMesh:
    world = dist.group.WORLD
    cached = _default_meshes.get(device_type)
    if cached is None or cached[0] is not world:
        cached = _default_meshes[device_type] = (world, init_device_mesh(device_type, (dist.get_world_size(),)))
    return cached[1]


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which named axes of a whole SPMD mesh are data parallel, for parameters that are already
    DTensors on that mesh (torchtitan's `full_dtensor` backend); FSDP2's `dp_mesh_dims`.

    Attributes:
        shard: the axis name (or names, flattened into one axis) `fully_shard` shards on.
        replicate: the axis name(s) replicating the shards (HSDP), or None.
    """

    shard: Optional[Union[str, tuple[str, ...]]] = None
    replicate: Optional[Union[str, tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims needs shard or replicate set, e.g. DataParallelMeshDims(shard='dp')")
        for field_name in ("shard", "replicate"):
            value = getattr(self, field_name)
            if value is not None and not isinstance(value, str) and not (
                isinstance(value, tuple) and value and all(isinstance(v, str) for v in value)
            ):
                raise TypeError(
                    f"DataParallelMeshDims.{field_name} must be a mesh axis name, a tuple of names or None, "
                    f"got {value!r}"
                )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def _dp_mesh(spmd_mesh: DeviceMesh, dims) -> tuple[DeviceMesh, tuple[int, ...], tuple[int, ...]]:
    """The data-parallel mesh of `spmd_mesh` that `dims` names (1-D, or 2-D for HSDP: replicate,
    shard), and the indices of its shard and replicate axes in `spmd_mesh`.

    `dims` is a `DataParallelMeshDims`, ours or torch's (the same fields): code that built torch's
    before `fsdp_graph.use_in_place_of_torch_fsdp()` passes it on unchanged."""
    if not hasattr(dims, "shard_names") or not hasattr(dims, "replicate_names"):
        raise TypeError(
            f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dims).__name__}; pass "
            f"fsdp_graph.DataParallelMeshDims(shard='dp_shard')"
        )
    names = spmd_mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "dp_mesh_dims needs a mesh with axis names; build it with "
            "init_device_mesh(device_type, shape, mesh_dim_names=(...))"
        )
    shard_names, replicate_names = tuple(dims.shard_names), tuple(dims.replicate_names)
    unknown = [n for n in (*shard_names, *replicate_names) if n not in names]
    if unknown:
        raise ValueError(f"dp_mesh_dims names {unknown}, which are not axes of the mesh {names}")
    if not shard_names:
        raise ValueError(
            f"dp_mesh_dims={dims!r} names no shard axis: fully_shard shards parameters; name the "
            f"axis to shard on, e.g. DataParallelMeshDims(shard='dp_shard', replicate={dims.replicate!r})"
        )
    shard_axes = tuple(names.index(n) for n in shard_names)
    replicate_axes = tuple(names.index(n) for n in replicate_names)
    for kind, axes in (("shard", shard_axes), ("replicate", replicate_axes)):
        if axes and list(axes) != list(range(axes[0], axes[0] + len(axes))):
            raise ValueError(
                f"dp_mesh_dims' {kind} axes {[names[a] for a in axes]} must be neighbouring axes of the "
                f"mesh {names}, in mesh order, to be flattened into one"
            )

    def submesh(axis_names: tuple[str, ...]) -> DeviceMesh:
        if len(axis_names) == 1:
            return spmd_mesh[axis_names[0]]
        return spmd_mesh[axis_names]._flatten("_".join(axis_names))

    shard_mesh = submesh(shard_names)
    if not replicate_names:
        return shard_mesh, shard_axes, replicate_axes
    return DeviceMesh._concatenate([submesh(replicate_names), shard_mesh]), shard_axes, replicate_axes
