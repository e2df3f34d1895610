"""`fully_shard` and `FSDPModule`: the same signature and behaviour as PyTorch's FSDP2."""

from __future__ import annotations

import copyreg
import functools
import logging
import os
import types
import warnings
from collections import OrderedDict
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .runtime.comms import AllGather, ReduceScatter
from .runtime.param import MeshInfo, ShardedParam
from .runtime.param_group import ParamGroup
from .runtime.state import FSDPState

logger = logging.getLogger(__name__)

# Set on every original parameter a group took over, so a later `fully_shard` that meets the same
# parameter (a tied weight) can tell which group owns it.
_OWNER_ATTR = "_fsdp_graph_param"


class FSDPModule:
    """Mixed into every module `fully_shard` was applied to: `FSDP<Cls>` is both `Cls` and this."""

    _fsdp_state: FSDPState

    def __call__(self, *args, **kwargs):
        # [Note: One frame for the root's hooks]
        # `torch.compile(module)` hands Dynamo `module.__call__`. Were that `nn.Module.__call__`
        # (a torch file Dynamo skips), the root's forward hooks would each become a frame of their
        # own and the root group's all-gather would be split from the forward graph. Defined here,
        # in a file Dynamo traces, the whole call (hooks and forward) becomes one frame, without
        # changing torch's `wrap_top_frame` config. In eager this is one plain Python call more.
        # Each FSDP class gets its own copy of this code object: see `_own_call`.
        if torch.compiler.is_compiling() and self._fsdp_state.eager_only_reason() is not None:
            return _call_on_eager_hooks(self, args, kwargs)  # [Note: Groups that stay on the eager hooks]
        return super().__call__(*args, **kwargs)

    def __new__(cls, *args, **kwargs):
        """Build the original class: `nn.Sequential` slicing calls `self.__class__(...)` on the
        sharded container, and its result holds modules, not a `fully_shard` call of its own."""
        orig = cls.__mro__[2]  # FSDP<Cls>, FSDPModule, Cls
        self = orig.__new__(orig) if orig.__new__ is object.__new__ else orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __reduce_ex__(self, protocol):
        # Pickle rebuilds an object with `cls.__new__(cls)` and then its state; the `__new__` above
        # would call `__init__` with no arguments. Dynamo's saved guards pickle the module tree.
        reduced = super().__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__:
            return (_new_for_unpickling, *reduced[1:])
        return reduced

    def __deepcopy__(self, memo):
        raise ValueError(
            f"a fully_shard'ed {type(self).__name__} cannot be deep-copied (its parameters are shards "
            f"tied to hooks and process groups); deepcopy the module before fully_shard, or copy its "
            f"state with state_dict()/load_state_dict()"
        )

    def _apply(self, *args, **kwargs):
        # `.to()`, `.float()`, ...: convert the shards, never a gathered copy that the next
        # reshard would throw away (as FSDP2 does).
        states = [state for state in self._states(recurse=True) if state.group is not None]
        for state in states:
            state.group.reshard()
        result = super()._apply(*args, **kwargs)
        for state in states:
            state.group.follow_moved_shards()
        return result

    def unshard(self, async_op: bool = False) -> Optional["UnshardHandle"]:
        """All-gather this module's group (not recursive). With `async_op`, returns a handle to wait
        on (the pre-forward also waits); without, waits and returns None, as FSDP2 does."""
        _check_bool("async_op", async_op)
        state = self._fsdp_state
        handle = UnshardHandle(state)
        if state.group is not None:
            state.group.unshard(async_op=async_op)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: drop that iteration's state (call on the root).

        In-flight reductions finish and are discarded, every group is resharded; gradients
        accumulated without sync (and HSDP sums kept by `set_requires_all_reduce(False)`) are
        dropped, so restart a gradient-accumulation sequence.
        """
        state = self._fsdp_state
        if not state.is_root:
            raise ValueError(
                f"reset_iter_state must be called on the root module (the one fully_shard was applied "
                f"to last), not on '{state.name}'"
            )
        state.reset_iter_state()

    def reshard(self) -> None:
        """Free the unsharded parameters and register the shards again."""
        group = self._fsdp_state.group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False keeps gradients unsharded and unreduced (accumulation); True reduces them again."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for state in self._states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps parameters unsharded after backward, so the next forward gathers nothing."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward
            if state.group is not None:
                state.group.set_reshard_after_forward(reshard_after_forward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward does not wait for its reduce-scatters (the next forward does)."""
        _check_bool("is_last_backward", is_last_backward)
        self._fsdp_state.ctx.is_last_backward = is_last_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-forward, issue the all-gathers of `modules` (asynchronously).
        Eager steps only: in compiled steps the schedule decides (logged once)."""
        _log_prefetch_in_compiled_steps()
        self._fsdp_state.forward_prefetch = _prefetch_states("set_modules_to_forward_prefetch", modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """In this module's pre-backward, issue the all-gathers of `modules` instead of the default.
        Eager steps only: in compiled steps the schedule decides (logged once)."""
        _log_prefetch_in_compiled_steps()
        self._fsdp_state.backward_prefetch = _prefetch_states("set_modules_to_backward_prefetch", modules)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by `factor` instead of the number of data-parallel
        ranks. Only this module's own group, as in FSDP2: call it on each module to change."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive number, got {factor!r}")
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in FSDP2): use `set_gradient_divide_factor`."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only, dividing separately (this module's group).

        fsdp_graph's collectives always sum and divide separately (gloo has no PREMUL_SUM or AVG),
        so the numbers do not change; what changes is when an all-reduce hook runs, as in FSDP2:
        with forced sums it sees the sum before the division, else the averaged gradient.
        """
        _check_bool("enable", enable)
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.reduce_controls.force_sum = enable

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters gradients but skips the replica all-reduce, keeping the sums
        until a backward with True all-reduces them (accumulation with less communication).
        No effect on a 1-D mesh. Such steps run on the eager hooks when compiled."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reduce_controls.all_reduce = requires_all_reduce

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: backward does not gather this module's group, for modules whose backward reads
        none of their parameters (an embedding). Gradients are still reduced. Runs eagerly when
        compiled (the graph's backward reads what the forward gathered)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.unshard_in_backward = unshard_in_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility; nothing to set. fsdp_graph always reduce-scatters every
        trainable parameter of a group on every rank, with zeros where a rank has no gradient and
        a flag so ranks agree which parameters got one ([Note: Every rank packs every parameter]
        in runtime/collectives.py): what FSDP2 does with this set to True, without the hang when
        it is False and ranks use different parameters."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's cap on reduce-scatter input buffers in flight. Validated and accepted; the eager
        runtime keeps one (FSDP2's default): it waits for a group's reduce-scatter before the next
        group packs, and compiled steps place buffers by the memory budget (passes/reorder.py)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Run `hook(reduced)` on this module's reduced gradients (flat, this rank's shard): after
        the replica all-reduce with HSDP, after the reduce-scatter otherwise; it may change them in
        place. On CUDA the hook runs on `stream` if given (ordered after the reduction and before
        the gradients are used, as in FSDP2), else on the reduce-scatter stream; without streams
        (CPU) it just runs. As in FSDP2, `stream` is refused with HSDP. Steps with a hook run on the
        eager hooks when compiled."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook expects a callable, got {hook!r}")
        if stream is not None and not callable(getattr(stream, "wait_stream", None)):
            raise TypeError(
                f"set_all_reduce_hook: stream must be a stream (e.g. torch.cuda.Stream()) or None, got "
                f"{type(stream).__name__}"
            )
        group = self._fsdp_state.group
        if group is None:
            return
        if stream is not None and group.mesh_info.is_hsdp:
            raise ValueError("set_all_reduce_hook: stream cannot be set with HSDP (a 2-D mesh)")
        group.reduce_controls.all_reduce_hook = hook
        group.reduce_controls.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Replace this module's all-gather (and its output buffer) with `comm`: an `AllGather`
        (`allocate` + `__call__(output, input, group, async_op=False)`), as in FSDP2. Steps with a
        custom comm run on the eager hooks when compiled."""
        _check_comm("set_custom_all_gather", comm)
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Replace this module's gradient reduce-scatter (and its buffers) with `comm`: a
        `ReduceScatter` (`allocate` + `__call__(output, input, group, op, async_op=False)`), as
        in FSDP2; it is asked for a SUM. Steps with a custom comm run on the eager hooks when compiled."""
        _check_comm("set_custom_reduce_scatter", comm)
        if self._fsdp_state.group is not None:
            self._fsdp_state.group.custom_reduce_scatter = comm

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """True: gradient reduce-scatters run on a process group of their own over the shard ranks
        (one per set of ranks), so they can progress alongside all-gathers; False: back to the
        shard group. Collective: call it on every rank of the mesh alike, as in FSDP2."""
        _check_bool("enable", enable)
        made: dict = {}
        for state in self._states(recurse):
            if state.group is not None:
                state.group.set_separate_reduce_scatter_group(enable, made)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next all-gathers wait for `event` (recorded after the optimizer step) instead of the
        whole current stream; once, so pass a new event every step. No effect without streams (CPU)."""
        self._fsdp_state.ctx.comm.post_optim_event = event

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's collective buffers from the process group's own allocator, where
        its backend has one (NCCL's, for zero-copy transfers), as FSDP2 does; a backend without one
        (gloo) keeps the caching allocator, so there it changes nothing. Refused after
        `set_custom_all_gather` / `set_custom_reduce_scatter`, whose comms allocate their own
        buffers, as in FSDP2. Compiled steps of a group that does allocate from the process group
        run on the eager hooks (a graph allocates its buffers itself)."""
        _check_bool("enable", enable)
        group = self._fsdp_state.group
        if group is None:
            return
        if group.custom_all_gather is not None or group.custom_reduce_scatter is not None:
            raise ValueError(
                f"set_allocate_memory_from_process_group_for_comm({enable}) on '{self._fsdp_state.name}', which "
                f"has a custom all-gather or reduce-scatter (set_custom_all_gather / set_custom_reduce_scatter): "
                f"its allocate() chooses the buffers; allocate from the process group there, or call this "
                f"instead of setting a custom comm"
            )
        group.allocate_from_process_group = enable
        group.uses_process_group_allocator = group.process_group_allocates()

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2: all-gather staging buffers in NCCL symmetric memory. Not supported by fsdp_graph:
        raises a ValueError (on a machine without CUDA and NCCL, FSDP2 cannot do it either)."""
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string such as 'NCCL', got {type(backend).__name__}")
        raise ValueError(
            f"set_symm_mem_for_comm({backend!r}): fsdp_graph does not gather into symmetric memory yet; "
            f"its all-gathers use buffers from the caching allocator. Remove the call"
        )

    def _states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state]
        states = []
        for module in self.modules():
            state = getattr(module, "_fsdp_state", None)
            if isinstance(state, FSDPState) and state not in states:
                states.append(state)
        return states


class UnshardHandle:
    """Returned by `FSDPModule.unshard`; `wait()` makes the unsharded parameters usable."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        if self._state.group is not None:
            self._state.group.wait_for_unshard()


def fully_shard(
    module: Union[nn.Module, list[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Optional[Union[bool, int]] = None,
    shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
):
    """Shard `module`'s parameters (those not already in a nested group) as one communication group.

    Parameters become DTensors sharded on dim 0 over `mesh` (1-D, or 2-D for HSDP: replicate on
    axis 0, shard on axis 1), under unchanged names. Parameters tensor parallelism already made
    DTensors (on the tp axis of the same mesh) become DTensors over (dp, tp); see README, Tensor
    parallel. The module's class becomes `FSDP<Cls>`. Call it bottom-up: blocks first, then the root.
    """
    modules = _check_modules(module)
    mesh = _check_mesh(mesh)
    _install_optimizer_check()
    mesh_info = MeshInfo(mesh)
    reshard_after_forward = _check_reshard_after_forward(reshard_after_forward, mesh_info)
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
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn must be callable or None, got {shard_placement_fn!r}")
    ignored = _check_ignored_params(ignored_params, modules)

    device = _mesh_device(mesh)
    shard_device = torch.device("cpu") if isinstance(offload_policy, CPUOffloadPolicy) else device
    pin_memory = isinstance(offload_policy, CPUOffloadPolicy) and offload_policy.pin_memory
    if pin_memory and not torch.cuda.is_available():
        # FSDP2 fails here too (pinning needs an accelerator), with a RuntimeError deep in pin_memory().
        raise ValueError(
            "CPUOffloadPolicy(pin_memory=True) pins the CPU shards for fast copies to the GPU, but no "
            "GPU is available; pass CPUOffloadPolicy(pin_memory=False)"
        )
    owners = _collect_params(modules, ignored)
    _check_devices(owners)
    _check_shardable(owners, mesh)
    _check_no_compile_regions(modules, owners)
    params = []
    for param, param_owners, fqn in owners:
        shard_dim = _shard_dim(shard_placement_fn, param, fqn)
        params.append(
            ShardedParam(
                param, param_owners, fqn, modules, mesh_info, device, shard_device, mp_policy.param_dtype, shard_dim,
                mp_policy=mp_policy,
            )
        )
    group = ParamGroup(params, mesh_info, device, mp_policy, reshard_after_forward) if params else None
    for param, sharded in zip((o[0] for o in owners), params):
        if pin_memory:
            sharded.pin_shard()
        setattr(param, _OWNER_ATTR, sharded)
        setattr(sharded.sharded_param, _OWNER_ATTR, sharded)
        sharded.install(sharded=True)
    for m in modules:
        _move_buffers(m, device)

    state = FSDPState(modules, group, mp_policy, reshard_after_forward, device)
    for m in modules:
        m._fsdp_state = state
        m.__class__ = _fsdp_class(type(m))
        _register_as_fully_shard(m)
    state.claim_root()
    return module


def _shard_dim(shard_placement_fn, param: nn.Parameter, fqn: str) -> int:
    """The dim `shard_placement_fn` shards `param` on (negative dims count from the end); 0 without one."""
    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for '{fqn}'; fsdp_graph shards every parameter: "
            f"return Shard(dim) for a dim of the parameter, or None for Shard(0)"
        )
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned {placement} for '{fqn}', which has {param.ndim} dims; return "
            f"Shard(dim) with -{param.ndim} <= dim < {param.ndim}"
        )
    return dim


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run `module.<method_name>` under the same unshard/reshard hooks as `forward`."""
    if not isinstance(method_name, str):
        raise TypeError(
            f"register_fsdp_forward_method expects the method's name as a str, got {method_name!r}; "
            f"e.g. register_fsdp_forward_method(model, 'generate')"
        )
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"register_fsdp_forward_method needs a module passed to fully_shard, got "
            f"{type(module).__name__}; call fully_shard(module) first"
        )
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


# -- helpers ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fsdp_class(cls: type) -> type:
    """`FSDP<Cls>`, made once per class, and findable by pickle as an attribute of this module.

    Dynamo's saved guards and compiled functions (`torch.compiler.load_compiled_function`) pickle
    classes by module and qualified name, and refuse a class whose qualified name is not its name.
    So the name is `FSDP<Cls>`, with a number after it when another class of that name was sharded
    first; a new process that shards the same models in the same order makes the same names.
    """
    name = f"FSDP{cls.__name__}"
    n = 1
    while name in globals():  # another sharded class's, or this module's own (a user class `Module`)
        n += 1
        name = f"FSDP{cls.__name__}{n}"
    fsdp_cls = type(name, (FSDPModule, cls), {"__call__": _own_call(cls, name)})
    fsdp_cls.__module__ = __name__
    globals()[name] = fsdp_cls
    return fsdp_cls


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


def _new_for_unpickling(cls: type, *args):
    return super(FSDPModule, cls).__new__(cls, *args)


@torch._dynamo.disable
def _call_on_eager_hooks(module: nn.Module, args: tuple, kwargs: dict):
    return nn.Module.__call__(module, *args, **kwargs)


def _own_call(cls: type, class_qualname: str):
    """`FSDPModule.__call__` under a code object of this class's own.

    Dynamo keeps what it learned about a frame (input shapes seen, hence which dims to make
    dynamic; cache entries; the recompile limit) per code object, keyed by file, line and name.
    Were every FSDP class to share one `__call__`, compiling a second model in the same process
    would count as a recompile with new shapes and trace it with dynamic shapes.
    """
    call = FSDPModule.__call__
    # Module and qualified name: two classes called `Block` in different files stay apart.
    name = f"FSDP{cls.__qualname__}.__call__ ({cls.__module__})"
    code = call.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=name)
    own = types.FunctionType(code, call.__globals__, name, call.__defaults__, call.__closure__)
    own.__qualname__ = f"{class_qualname}.__call__"  # found through the class, as pickle looks it up
    return own


def _check_comm(method: str, comm: object) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__, e.g. a "
            f"subclass of fsdp_graph.{'AllGather' if 'gather' in method else 'ReduceScatter'}; got {comm!r}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


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
        if isinstance(m, OptimizedModule):
            raise ValueError(
                f"fully_shard got a torch.compile'd module (OptimizedModule of "
                f"{type(m._orig_mod).__name__}); shard the original module first, then compile: "
                f"fully_shard(model); model = torch.compile(model, backend='fsdp_graph')"
            )
        if isinstance(m, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module"
            )
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) or type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard cannot hook {type(m).__name__}, which has no forward; shard its "
                f"children one by one, or pass them as a list: fully_shard(list(container))"
            )
    return modules


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


def _check_reshard_after_forward(value, mesh_info: MeshInfo):
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
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


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _is_inside(module: nn.Module, ancestors: tuple[nn.Module, ...]) -> bool:
    return any(module is m for a in ancestors for m in a.modules())


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
                taken = getattr(param, _OWNER_ATTR, None)
                if taken is not None:
                    _check_taken(taken, owner, fqn, modules)
                    continue
                entry = found.setdefault(id(param), (param, [], fqn))
                if (owner, name) not in [(o, n) for o, n in entry[1]]:
                    entry[1].append((owner, name))
    return list(found.values())


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


def _check_shardable(owners, mesh: DeviceMesh) -> None:
    """Every parameter can be sharded on dim 0 over `mesh`; raise once listing those that cannot."""
    problems = []
    for param, _, fqn in owners:
        if param.dim() == 0:
            problems.append(
                f"'{fqn}' is a 0-dim (scalar) parameter and has no dim 0 to shard; keep it replicated "
                f"with ignored_params={{...}} or give it shape (1,)"
            )
        elif isinstance(param, DTensor):
            problem = _tensor_parallel_problem(param, mesh)
            if problem is not None:
                problems.append(f"'{fqn}' {problem}")
    if problems:
        raise ValueError("fully_shard cannot shard these parameters:\n" + "\n".join(f"  - {p}" for p in problems))


def _tensor_parallel_problem(param: DTensor, mesh: DeviceMesh) -> Optional[str]:
    """Why a DTensor parameter (tensor parallel) cannot be sharded over the data-parallel `mesh`,
    or None. See [Note: Sharding a tensor-parallel parameter] in runtime/param.py."""
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


def _check_no_compile_regions(modules: list[nn.Module], owners) -> None:
    """Raise if a module whose forward reads this group's parameters is a
    `torch.compiler.nested_compile_region`: see README, Known limits."""
    owner_ids = {id(m) for _, param_owners, _ in owners for m, _ in param_owners}
    for root in modules:
        for name, sub in root.named_modules():
            marked = getattr(getattr(sub, "forward", None), "__marked_compile_region_fn__", None)
            if marked is not None and any(id(m) in owner_ids for m in sub.modules()):
                where = f"{type(sub).__name__}.forward" + (f" (submodule '{name}')" if name else "")
                raise ValueError(
                    f"{where} is a torch.compiler.nested_compile_region and reads parameters that "
                    f"fully_shard gathers; Dynamo cannot reuse such a region. Remove the decorator: "
                    f"torch.compile(model, backend='fsdp_graph') compiles the whole step as one graph"
                )


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                sub._buffers[name] = buf.to(device)


@functools.lru_cache(maxsize=None)
def _install_optimizer_check() -> None:
    """Register `_before_optimizer_step` before every optimizer step, once per process.

    [Note: Optimizer built before fully_shard]
    `fully_shard` replaces each parameter on its module with a new DTensor shard. An optimizer built
    earlier holds the replaced parameters: they never get a gradient, so its `step()` silently does
    nothing. An optimizer instance cannot be reached from the module, so a global step pre-hook
    checks every optimizer's parameters instead (a dict lookup per parameter and step). It also
    catches a step taken while gradients are still unreduced or in flight.

    [Note: An optimizer step makes gathered parameters stale]
    A group still gathered at a step (`set_reshard_after_backward(False)`, or `unshard()` before
    the step) holds copies of the shards the step is about to change, and its next pre-forward would
    reuse them: one forward and backward on the old values, silently. torch's FSDP2 does exactly
    that. So the step reshards every group it updates, and the next forward gathers the new values;
    the gathered copies it frees could not have been reused correctly. This also keeps a compiled
    step after it consistent: traced groups read the shards, and `named_parameters()` shows the
    shards again instead of a stale gathered copy with no gradient.
    """
    register_optimizer_step_pre_hook(_before_optimizer_step)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    """See [Note: Optimizer built before fully_shard] and [Note: An optimizer step makes gathered
    parameters stale]."""
    stale, unreduced = [], []
    contexts, groups = {}, {}  # by id, so the check stays linear in the number of parameters
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            owner = p.__dict__.get(_OWNER_ATTR)
            if owner is None:
                continue
            if p is not owner.sharded_param:
                stale.append(owner.fqn)
            elif owner.unreduced_grad is not None or (owner.unsharded_param is not None and owner.unsharded_param.grad is not None):
                unreduced.append(owner.fqn)
            state = owner.group_modules[0]._fsdp_state
            contexts.setdefault(id(state.ctx), state.ctx)
            groups.setdefault(id(state.group), state.group)
    if stale:
        raise ValueError(
            f"{type(optimizer).__name__} holds parameters that fully_shard (or a later "
            f"load_state_dict(assign=True)) replaced, e.g. {stale[:3]}; they never get gradients. "
            f"Build the optimizer after fully_shard: optimizer = {type(optimizer).__name__}"
            f"(model.parameters(), ...)"
        )
    if unreduced:
        raise ValueError(
            f"{type(optimizer).__name__}.step() was called while gradients of {unreduced[:3]} are "
            f"not reduced yet (set_requires_gradient_sync(False) in the last backward); call "
            f"model.set_requires_gradient_sync(True) before the last micro-batch's backward"
        )
    if any(ctx.comm.pending_reduce_scatters for ctx in contexts.values()):
        raise ValueError(
            f"{type(optimizer).__name__}.step() was called while gradient reduce-scatters are still "
            f"in flight (set_is_last_backward(False)); call model.set_is_last_backward(True) before "
            f"the step's last backward"
        )
    for group in groups.values():  # [Note: An optimizer step makes gathered parameters stale]
        group.reshard()


@functools.lru_cache(maxsize=None)
def _log_prefetch_in_compiled_steps() -> None:
    logger.info(
        "fsdp_graph: set_modules_to_forward/backward_prefetch apply to eager steps; in steps compiled "
        "with backend='fsdp_graph' the compiled schedule (passes/reorder.py) decides what to prefetch"
    )


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


def _prefetch_states(method: str, modules) -> list[FSDPState]:
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"{method} expects a list of FSDPModule, got {type(modules).__name__}")
    states = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"{method} got a {type(m).__name__} that is not sharded; pass modules that "
                f"fully_shard was applied to"
            )
        states.append(m._fsdp_state)
    return states


__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
