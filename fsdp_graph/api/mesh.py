"""The mesh `fully_shard` shards over: the one it was given, checked, or one default mesh over the
default process group (initialised from torchrun's environment when there is none)."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def _check_mesh(mesh: Optional[DeviceMesh]) -> DeviceMesh:
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
    if mesh.ndim not in (1, 2):
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
