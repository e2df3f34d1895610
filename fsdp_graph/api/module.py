"""`FSDPModule`, mixed into every module `fully_shard` was applied to: FSDP2's methods, one by one,
with the checks of their arguments; `UnshardHandle`; and the `FSDP<Cls>` classes, made here so that
pickle finds them and their `__call__` in this module."""

from __future__ import annotations

import copyreg
import logging
import types
import functools
import warnings
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..runtime.custom_comms import AllGather, ReduceScatter
from ..runtime.state import FSDPState
from ..traced.call import call_on_eager_hooks, traced_call
from ..traced.scope import traced_scope

logger = logging.getLogger(__name__)


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
        # Each FSDP class gets its own copy of this code object: see `_own_call`. `compile()` below
        # gives `module.compile()` the same frame.
        if torch.compiler.is_compiling():
            if traced_scope() != "block" and self._fsdp_state.eager_only_reason() is not None:
                return call_on_eager_hooks(self, args, kwargs)  # [Note: Groups that stay on the eager hooks]
            return traced_call(self, args, kwargs)  # traced/call.py
        return super().__call__(*args, **kwargs)

    def compile(self, *args, **kwargs) -> None:
        """`nn.Module.compile` (compile this module's calls in place, as torchtitan and Lightning
        do), with the module's hooks in the compiled frame as under `torch.compile(module)`:
        [Note: One frame for the root's hooks]. torch's own compiles `nn.Module._call_impl`, a
        frame whose hooks Dynamo runs one by one outside the graph."""
        self._compiled_call_impl = torch.compile(self.__call__, *args, **kwargs)  # its own code object: `_own_call`
        self._fsdp_state.compiled_in_place = True  # see `_call_hooks_and_forward`

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
        for state in states:  # [Note: The sharded parameter is the one its module holds]
            state.group.follow_registered_params()
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

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _check_bool("reshard_after_forward", reshard_after_forward, ArgumentTypeError)
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
        """True: after a backward that reduces, every trainable parameter gets a gradient, zeros
        where no rank had one (so AdamW decays and steps it), as in FSDP2; False (the default)
        leaves those `.grad` None, as the unsharded model does. Either way fsdp_graph reduce-scatters
        every trainable parameter of a group on every rank, with zeros where a rank has no gradient
        and a flag so ranks agree which got one ([Note: Every rank packs every parameter] in
        runtime/collectives.py), so ranks that use different parameters never hang."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for state in self._states(recurse):
            if state.group is not None:
                state.group.reduce_controls.zeros_for_unused = reduce_scatter_unused_params

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


def _new_for_unpickling(cls: type, *args):
    return super(FSDPModule, cls).__new__(cls, *args)


def _check_comm(method: str, comm: object) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__, e.g. a "
            f"subclass of fsdp_graph.{'AllGather' if 'gather' in method else 'ReduceScatter'}; got {comm!r}"
        )


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type where FSDP2 raises `ValueError` (`reshard_after_forward`): code written for
    torch's `fully_shard` catches it as a `ValueError`, and it is the `TypeError` it is."""


def _check_bool(name: str, value: object, error: type[Exception] = TypeError) -> None:
    if not isinstance(value, bool):
        raise error(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


@functools.lru_cache(maxsize=None)
def _log_prefetch_in_compiled_steps() -> None:
    logger.info(
        "fsdp_graph: set_modules_to_forward/backward_prefetch apply to eager steps; in steps compiled "
        "with backend='fsdp_graph' the compiled schedule (passes/reorder.py) decides what to prefetch"
    )


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


def _fsdp_states(model: nn.Module, caller: str) -> list[FSDPState]:
    """The FSDP states under `model`, each once; for the functions that take a whole model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller} expects an nn.Module, got {type(model).__name__}")
    states = []
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if isinstance(state, FSDPState) and state not in states:
            states.append(state)
    if not states:
        raise ValueError(f"{caller} found no module that fully_shard was applied to; call fully_shard first")
    return states


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
