"""What `fully_shard` checks before it shards anything: the modules, `reshard_after_forward`,
`ignored_params`, parameters shared with other groups, devices, tensor-parallel placements and
compile regions. Each raises a `ValueError` or `TypeError` whose message names the fix."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..runtime.mesh_info import MeshInfo
from ..runtime.param import ShardedParam
from .module import ArgumentTypeError, FSDPModule


def _check_modules(module) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not modules:
        raise ValueError("fully_shard got an empty list; pass a module or a non-empty list of modules")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard expects an nn.Module or a list of them, got {type(m).__name__}"
            )
        if any(m is other for other in modules[:i]):
            raise ValueError(
                f"fully_shard got the same {type(m).__name__} twice in its list (position {i}); "
                f"list each module once"
            )
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or (
            type(m).forward is nn.Module.forward and not isinstance(m, OptimizedModule)  # its forward: an attribute
        ):
            raise ValueError(
                f"fully_shard cannot hook {type(m).__name__}, which has no forward; shard its "
                f"children one by one, or pass them as a list: fully_shard(list(container))"
            )
    return modules


def _check_reshard_after_forward(value, mesh_info: MeshInfo):
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise ArgumentTypeError(
            f"reshard_after_forward must be a bool, an int or None, got {type(value).__name__}"
        )
    if value < 1 or mesh_info.shard_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must divide the shard group size "
            f"{mesh_info.shard_size}; use a divisor such as the ranks per node, or True/False"
        )
    return value


def _check_ignored_params(ignored_params, modules) -> set[int]:
    if ignored_params is None:
        return set()
    if not isinstance(ignored_params, (set, frozenset, list, tuple)):
        raise TypeError(f"ignored_params must be a set of nn.Parameter, got {type(ignored_params).__name__}")
    # Parameters of other modules are allowed and ignored, as in FSDP2: one set of every ignored
    # parameter of the model can be passed to each fully_shard call.
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must hold nn.Parameter objects, got {type(p).__name__}")
    return {id(p) for p in ignored_params}


def _is_inside(module: nn.Module, ancestors: tuple[nn.Module, ...]) -> bool:
    return any(module is m for a in ancestors for m in a.modules())


def _check_taken(taken: ShardedParam, owner: nn.Module, fqn: str, modules) -> None:
    """A parameter another group took: fine if nested below us, an error otherwise."""
    if _is_inside(owner, taken.group_modules) and all(
        not _is_inside(m, taken.group_modules) for m in modules
    ):
        return  # a nested group's parameter
    if any(_is_inside(m, taken.group_modules) for m in modules):
        raise ValueError(
            f"fully_shard was applied to a parent before this module: '{fqn}' already belongs to "
            f"the group of {[type(m).__name__ for m in taken.group_modules]}; apply fully_shard "
            f"bottom-up (children first, then the root)"
        )
    raise ValueError(
        f"Parameter '{fqn}' is shared with '{taken.fqn}', which is already in another group; "
        f"shard both owners together with fully_shard([module_a, module_b])"
    )


def _check_devices(owners) -> None:
    devices = {p.device for p, _, _ in owners}
    if len(devices) > 1:
        listing = ", ".join(f"'{fqn}' on {p.device}" for p, _, fqn in owners[:8])
        raise ValueError(
            f"fully_shard got parameters on different devices ({sorted(map(str, devices))}): "
            f"{listing}; move the module to one device first, e.g. module.to(device)"
        )


def _check_shardable(owners, meshes: list[DeviceMesh], spmd: bool = False) -> None:
    """Every parameter can be sharded on dim 0 over its mesh (`meshes`, one per owner); raise once
    listing those that cannot. `spmd`: the parameters are on a whole SPMD mesh, checked by
    `_check_spmd_params`."""
    problems = []
    for (param, _, fqn), mesh in zip(owners, meshes):
        if param.dim() == 0:
            problems.append(
                f"'{fqn}' is a 0-dim (scalar) parameter and has no dim 0 to shard; keep it replicated "
                f"with ignored_params={{...}} or give it shape (1,)"
            )
        elif isinstance(param, DTensor) and not spmd:
            problem = _tensor_parallel_problem(param, mesh)
            if problem is not None:
                problems.append(f"'{fqn}' {problem}")
    if problems:
        raise ValueError("fully_shard cannot shard these parameters:\n" + "\n".join(f"  - {p}" for p in problems))


def _check_spmd_params(owners, spmd_mesh: DeviceMesh, spmd_axes) -> None:
    """With `dp_mesh_dims`: every parameter is a DTensor on `spmd_mesh`, `Replicate()` on the
    data-parallel axes and `Shard`/`Replicate` elsewhere ([Note: Parameters on the whole SPMD mesh]
    in runtime/tp_layout.py). Raise once, listing every parameter that is not."""
    dp_axes = {axis for axes in spmd_axes for axis in axes}
    names = spmd_mesh.mesh_dim_names
    problems = []
    for param, _, fqn in owners:
        if not isinstance(param, DTensor):
            problems.append(
                f"'{fqn}' is a plain {type(param).__name__}: with dp_mesh_dims every parameter must be a "
                f"DTensor on the whole mesh (e.g. distribute_module(module, mesh) first)"
            )
        elif param.device_mesh != spmd_mesh:
            problems.append(f"'{fqn}' is a DTensor on {param.device_mesh}, not on fully_shard's mesh {spmd_mesh}")
        else:
            for axis, placement in enumerate(param.placements):
                if axis in dp_axes and not isinstance(placement, Replicate):
                    problems.append(f"'{fqn}' is {placement} on the data-parallel axis '{names[axis]}'; expected Replicate()")
                elif not (type(placement) is Shard or isinstance(placement, Replicate)):
                    problems.append(f"'{fqn}' is {placement} on axis '{names[axis]}'; expected Shard(dim) or Replicate()")
    if problems:
        raise ValueError("fully_shard(..., dp_mesh_dims=...) cannot shard these parameters:\n" + "\n".join(f"  - {p}" for p in problems))


def _tensor_parallel_problem(param: DTensor, mesh: DeviceMesh) -> Optional[str]:
    """Why a DTensor parameter (tensor parallel) cannot be sharded over the data-parallel `mesh`,
    or None. See [Note: Sharding a tensor-parallel parameter] in runtime/tp_layout.py."""
    tp_mesh, placements = param.device_mesh, tuple(param.placements)
    fix = (
        "build one mesh = init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')), "
        "apply parallelize_module(model, mesh['tp'], plan), then fully_shard(block, mesh=mesh['dp'])"
    )
    if tp_mesh.ndim != 1:
        return (
            f"is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh}; fsdp_graph composes with 1-D tensor "
            f"parallelism only: {fix}"
        )
    for placement in placements:
        if not (type(placement) is Shard or isinstance(placement, Replicate)):
            return (
                f"is a DTensor with placements {placements}; a tensor-parallel parameter must be "
                f"Shard(dim) or Replicate() on its mesh (as ColwiseParallel / RowwiseParallel leave it)"
            )
    if tp_mesh.device_type != mesh.device_type:
        return f"is a DTensor on a {tp_mesh.device_type} mesh, but fully_shard's mesh is {mesh.device_type}; {fix}"
    if tp_mesh.mesh_dim_names is None or mesh.mesh_dim_names is None:
        return (
            f"is a DTensor on mesh {tp_mesh} and fully_shard's mesh is {mesh}; combining tensor "
            f"parallelism with fully_shard needs both to be named axes of one mesh: {fix}"
        )
    try:
        DeviceMesh._concatenate([mesh, tp_mesh])
    except RuntimeError as error:  # other root meshes, or overlapping axes
        return (
            f"is a DTensor on mesh {tp_mesh}, which cannot be combined with fully_shard's mesh {mesh} "
            f"into one (dp, tp) mesh ({error}); both must be disjoint axes of one mesh: {fix}"
        )
    return None

