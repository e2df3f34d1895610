"""`fully_shard` (FSDP2's signature and behaviour): it shards a module's parameters as one group and
makes its class `FSDP<Cls>`; also `register_fsdp_forward_method` and `share_comm_ctx`."""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from typing import Callable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh

from ..runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..runtime.mesh_info import MeshInfo
from ..runtime.multi_mesh_group import group_by_mesh
from ..runtime.param import OWNER_ATTR, ShardedParam
from ..traced.state import TracedGroup, TracedState
from .module import FSDPModule, _fsdp_class
from .checks import (
    _check_devices,
    _check_spmd_params,
    _check_ignored_params,
    _check_modules,
    _check_reshard_after_forward,
    _check_shardable,
    _check_taken,
)
from .mesh import DataParallelMeshDims, _check_mesh, _dp_mesh, _mesh_device
from .optimizer_check import _install_optimizer_check
from .placement import resolve_placements, shard_dim


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], object]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims: Optional[DataParallelMeshDims] = None,
):
    """Shard `module`'s parameters (those not already in a nested group) as one communication group.

    Parameters become DTensors sharded on dim 0 over `mesh` (1-D, or 2-D for HSDP: replicate on
    axis 0, shard on axis 1), under unchanged names. Parameters tensor parallelism already made
    DTensors (on the tp axis of the same mesh) become DTensors over (dp, tp); see docs/composition.md,
    Tensor parallel. With `dp_mesh_dims`, `mesh` is a whole SPMD mesh on which every parameter is
    already a DTensor, `Replicate()` on the data-parallel axes `dp_mesh_dims` names (torchtitan's
    `full_dtensor`). `shard_placement_fn` returns, per parameter, None, `Shard(dim)`, or a `ShardPlacementResult`
    (torch's, or any object with `placement` and `mesh_info`) sharding it over a mesh of its own, as expert
    parallelism does (fsdp_graph/api/placement.py). The module's class becomes `FSDP<Cls>`. Call it
    bottom-up: blocks first, then the root.
    """
    modules = _check_modules(module)
    spmd_axes = ((), ())
    if dp_mesh_dims is not None:
        spmd_mesh = _check_mesh(mesh, any_ndim=True)
        mesh, *spmd_axes = _dp_mesh(spmd_mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(  # FSDP2's type and rule
                f"reshard_after_forward={reshard_after_forward} (an int) is not supported with dp_mesh_dims; "
                f"pass True or False"
            )
    mesh = _check_mesh(mesh)
    _install_optimizer_check()
    mesh_info = MeshInfo(mesh)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh_info)
    mp_policy, offload_policy = _check_policies(mp_policy, offload_policy)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {shard_placement_fn!r}")
    ignored = _check_ignored_params(ignored_params, modules)

    device = _mesh_device(mesh)
    shard_device, pin_memory = _shard_device(offload_policy, device)
    owners = _collect_params(modules, ignored)
    _check_devices(owners)
    if dp_mesh_dims is not None:
        _check_spmd_params(owners, spmd_mesh, spmd_axes)
    placements = resolve_placements(shard_placement_fn, owners, mesh_info, spmd=dp_mesh_dims is not None)
    _check_shardable(owners, [info.mesh for _, info in placements], spmd=dp_mesh_dims is not None)
    params = []
    for (param, param_owners, fqn), (placement, param_mesh_info) in zip(owners, placements):
        params.append(
            ShardedParam(
                param, param_owners, fqn, modules, param_mesh_info, device, shard_device, mp_policy.param_dtype,
                shard_dim(placement, param, fqn), mp_policy=mp_policy, spmd_axes=tuple(spmd_axes),
            )
        )
    group = group_by_mesh(
        params, mesh_info, lambda members, info: TracedGroup(members, info, device, mp_policy, reshard_after_forward)
    )
    if pin_memory and group is not None:
        group.pin_shards()
    for param, sharded in zip((o[0] for o in owners), params):
        setattr(param, OWNER_ATTR, sharded)
        sharded.install(sharded=True)
        sharded.follow_registered_param()  # our attribute and hooks on the installed shard
    for m in modules:
        _move_buffers(m, device)

    _become_sharded(modules, TracedState(modules, group, mp_policy, reshard_after_forward, device))
    return module


def _check_policies(mp_policy, offload_policy) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The policies as ours (`_ours`), or a TypeError naming what to pass."""
    mp_policy, offload_policy = _ours(mp_policy), _ours(offload_policy)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}; "
            f"pass mp_policy=MixedPrecisionPolicy(param_dtype=...)"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            f"offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got "
            f"{type(offload_policy).__name__}"
        )
    return mp_policy, offload_policy


def _shard_device(offload_policy: OffloadPolicy, device: torch.device) -> tuple[torch.device, bool]:
    """Where the shards live (the CPU under `CPUOffloadPolicy`), and whether they are pinned."""
    shard_device = torch.device("cpu") if isinstance(offload_policy, CPUOffloadPolicy) else device
    pin_memory = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    if pin_memory and not torch.cuda.is_available():
        # FSDP2 fails here too (pinning needs an accelerator), with a RuntimeError deep in pin_memory().
        raise ValueError(
            "CPUOffloadPolicy(pin_memory=True) pins the CPU shards for fast copies to the GPU, but no "
            "GPU is available; pass CPUOffloadPolicy(pin_memory=False)"
        )
    return shard_device, pin_memory


def _become_sharded(modules: tuple[nn.Module, ...], state: TracedState) -> None:
    """Each module takes `state`, becomes an `FSDP<Cls>`, and `state` claims every state below."""
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
        _register_as_fully_shard(m)
    state.claim_root()
    for m in modules:
        for method_name in m.__dict__.pop(_PENDING_FORWARD_METHODS, ()):
            register_fsdp_forward_method(m, method_name)


_POLICIES = {cls.__name__: cls for cls in (MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy)}


def _ours(policy):
    """torch's FSDP2 policy as ours (the same fields): frameworks may build torch's before
    `fsdp_graph.use_in_place_of_torch_fsdp()` puts ours in its place. Anything else unchanged."""
    ours = _POLICIES.get(type(policy).__name__)
    if ours is None or isinstance(policy, ours) or not type(policy).__module__.startswith("torch.distributed."):
        return policy
    return ours(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(ours)})




# Method names `register_fsdp_forward_method` was given for a module not sharded yet, in the
# module's `__dict__` until `fully_shard` registers them.
_PENDING_FORWARD_METHODS = "_fsdp_graph_pending_forward_methods"


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` under the same unshard/reshard hooks as `forward`. On a module
    not passed to `fully_shard` it does nothing, as FSDP2's; if `fully_shard` is applied to that
    module later, it registers the method then."""
    if not isinstance(method_name, str):
        raise TypeError(
            f"register_fsdp_forward_method expects the method's name as a str, got {method_name!r}; "
            f"e.g. register_fsdp_forward_method(model, 'generate')"
        )
    if not isinstance(module, FSDPModule):
        # FSDP2 returns here, so that one script runs with and without sharding. A module sharded
        # later gets the hooks then (FSDP2's would silently run the method on sharded parameters).
        if isinstance(module, nn.Module):
            pending = module.__dict__.setdefault(_PENDING_FORWARD_METHODS, [])
            if method_name not in pending:
                pending.append(method_name)
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._fsdp_state

    @functools.wraps(method)
    def run_with_hooks(*args, **kwargs):
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward_hook(module, args, output)

    object.__setattr__(module, method_name, run_with_hooks)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make several roots (pipeline stages) share the first one's streams and buffers, as FSDP2's."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"share_comm_ctx expects a list of FSDPModule, got {type(modules).__name__}")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"share_comm_ctx expects modules fully_shard was applied to, got {type(m).__name__}")
    if not modules:
        return
    comm = modules[0]._fsdp_state.ctx.comm
    for m in modules[1:]:
        ctx = m._fsdp_state.ctx
        ctx.comm = comm
        for state in ctx.states:
            if state.group is not None:
                state.group.comm = comm


def _register_as_fully_shard(module: nn.Module) -> None:
    """Mark `module` in torch's composable-API registry as managed by `fully_shard`.

    [Note: Known to torch's composable APIs as fully_shard]
    torch's composable APIs keep, on each module they were applied to, a registry of API names
    (`torch.distributed._composable.contract`: `module.__dict__[REGISTRY_KEY]`, an ordered dict
    from the API's function name to a `RegistryItem`) and read it with `_get_registry`. `replicate`
    leaves modules whose registry holds "fully_shard" to that API: it neither turns their DTensor
    parameters into local tensors nor all-reduces their gradients. So a model whose blocks
    fsdp_graph sharded composes with `replicate` around it as with torch's `fully_shard`. Only the
    registry entry is written, as `contract` writes it; the state `contract` also stores belongs to
    torch's own `fully_shard` and is not ours to fake. torch's `fully_shard` on the same module then
    refuses, as it would after itself.
    """
    registry = module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())
    registry.setdefault("fully_shard", RegistryItem())


def _collect_params(modules, ignored: set[int]):
    """(param, [(owner, name), ...], fqn) for every parameter this call takes over."""
    found: dict[int, tuple[nn.Parameter, list, str]] = {}
    for root_index, root in enumerate(modules):
        prefix = f"[{root_index}]." if len(modules) > 1 else ""
        for module_name, owner in root.named_modules(remove_duplicate=False):
            for name, param in owner._parameters.items():
                if param is None or id(param) in ignored:
                    continue
                fqn = prefix + (f"{module_name}.{name}" if module_name else name)
                taken = getattr(param, OWNER_ATTR, None)
                if taken is not None:
                    _check_taken(taken, owner, fqn, modules)
                    continue
                entry = found.setdefault(id(param), (param, [], fqn))
                if (owner, name) not in [(o, n) for o, n in entry[1]]:
                    entry[1].append((owner, name))
    return list(found.values())


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)
