"""`FSDPModule`, mixed into every module `fully_shard` was applied to: FSDP2's methods, one by one,
with the checks of their arguments; `UnshardHandle`; and the `FSDP<Cls>` classes, made here so that
pickle finds them and their `__call__` in this module."""

from __future__ import annotations

import copyreg
import dataclasses
import logging
import re
import types
import weakref
import functools
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .scope import traced_regions, traced_scope
from ..runtime.custom_comms import AllGather, ReduceScatter
from ..runtime import traced
from ..runtime.state import FSDPState, kind_of, region_state

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
                return _call_on_eager_hooks(self, args, kwargs)  # [Note: Groups that stay on the eager hooks]
            return _traced_call(self, args, kwargs)
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


def _traced_call(module: nn.Module, args: tuple, kwargs: dict):
    """A module call while Dynamo traces: inside the step's graph, or one of the ways out of it
    (groups that stay on the eager hooks leave in `FSDPModule.__call__`)."""
    if traced_scope() == "block":
        return _call_in_block_scope(module, args, kwargs)  # [Note: Compile scope] in fsdp_graph/api/scope.py
    if module._fsdp_state.hooks_around_compiled_body is not None:
        if module._fsdp_state.traces_as_region():
            return _call_as_region(module, *_flat_call(args, kwargs), every_block=False)  # [Note: Blocks as compile regions]
        return _call_around_compiled_body(module, args, kwargs)  # [Note: Compile regions under fully_shard]
    if traced_regions() == "blocks" and module._fsdp_state.traces_as_region(every_block=True):
        layout, leaves = _flat_call(args, kwargs)
        if _seen(module._fsdp_state.region_id, layout):  # a block of its kind traced inline already
            return _call_as_region(module, layout, leaves, every_block=True)  # [Note: Every block a compile region]
    return _call_hooks_and_forward(module, args, kwargs)


@dataclasses.dataclass
class _KindTraced:
    """A kind of block the trace under way traced inline: its first block's `region_id` (`first`,
    not the module, which the record would keep alive) and name from the root, the names of
    Dynamo's guards before its trace (`guards_before`), then the attributes of the block that trace
    guarded the values of (`guarded`, read at the next block of the kind), and the values of those
    attributes of the blocks traced inline so far (`inline`). `node_before`: the graph's last node
    before its trace, until the next block of the kind reads `reads_free_numbers` from the nodes
    after it ([Note: Numbers a region cannot take from outside])."""

    first: int
    name: str
    guards_before: frozenset
    node_before: Optional[torch.fx.Node]
    guarded: Optional[tuple] = None
    reads_free_numbers: bool = False
    inline: set = dataclasses.field(default_factory=set)


# The trace now under way (its TracingContext, which Dynamo makes anew for every attempt at a frame)
# -> {kind: _KindTraced}. Keyed by the trace itself, not by its compile id: Dynamo numbers frames
# from 0 again after `torch._dynamo.reset()`, and another model's trace must never read this one's.
_kinds_traced: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@torch._dynamo.assume_constant_result
def _seen(region_id: int, layout: str) -> bool:
    """Whether the trace under way already traced a block of this kind (`kind_of` of the block of
    the state `region_id` names), called with arguments of this layout (`_flat_call`), inline,
    with the values of the attributes that block's trace guarded on; if not, it will now. Dynamo
    runs it as plain Python while it traces ([Note: Every block a compile region]). It takes
    constants, not the module: a module argument would leave a guard on the block's identity, which
    fails Dynamo's reuse of the next block's region. So the kind is read here, from the block as it
    is now, outside the trace."""
    trace = torch._guards.TracingContext.try_get()
    if trace is None:  # no trace under way: nothing traced before to reuse
        return False
    if trace not in _kinds_traced:
        _kinds_traced.clear()  # one trace at a time: only the one under way is kept
        _kinds_traced[trace] = {}
    state = region_state(region_id)
    block = state.modules[0]
    kind = (kind_of(block), layout)
    traced_kind = _kinds_traced[trace].get(kind)
    if traced_kind is None:
        _kinds_traced[trace][kind] = _KindTraced(region_id, state.name, _guard_names(), _last_node())
        return False
    if traced_kind.guarded is None:  # [Note: Numbers a block's trace guarded on]
        added = _guard_names() - traced_kind.guards_before
        traced_kind.guarded = _attributes_guarded(traced_kind.name, added)
        traced_kind.reads_free_numbers = _reads_free_numbers(traced_kind.node_before)
        traced_kind.node_before = None  # the graph is the trace's, not the record's
        first = region_state(traced_kind.first)
        if first is not None:
            traced_kind.inline.add(_values(first.modules[0], traced_kind.guarded))
    if traced_kind.reads_free_numbers:  # [Note: Numbers a region cannot take from outside]
        return False
    values = _values(block, traced_kind.guarded)
    if values in traced_kind.inline:
        return True
    traced_kind.inline.add(values)
    return False


# [Note: Numbers a block's trace guarded on]
# A block's kind holds no numbers (a layer index differs in every block), yet a block's code may
# branch on one: `if self.index % 2: ...` sends every other block another way, into a graph break
# for instance, which torch makes an error inside a region. Dynamo guards on every value the code
# took as a constant, so the guards the kind's first block's inline trace added name the numbers
# its code read: those on the block's own attributes (a source below the block's name, compared by
# value: CONSTANT_MATCH, EQUALS_MATCH). Read at the kind's next block, these attributes' values join
# the kind: a block whose values no block traced inline had goes inline too, as the first of its
# own kind. A layer index the code does not read (a Llama's, without a cache) leaves no guard, and
# its blocks stay one kind. What the code reads outside the block (global state) is not covered,
# but for a number Dynamo left symbolic: [Note: Numbers a region cannot take from outside].

# [Note: Numbers a region cannot take from outside]
# A number Dynamo does not take as a constant (a module-level float the script changed between
# steps, which Dynamo compiles again unspecialized) enters the graph as a tensor input and its
# `.item()`, a float with no source of its own. A region body that reads it takes that `.item()`
# from the enclosing graph, and torch 2.13 cannot reuse such a body: Dynamo raises "Freevar has no
# source" at the region's first call; a marked region fails too, under torch.compile alone
# (examples/repro/region_module_level_float.py).
# A symbolic int is reused fine. So a kind whose first block's inline trace used a symbolic float
# or bool that is not a graph input is traced inline in every block, as with regions="marked".
# What the trace did between that block and the kind's next one counts too (the root reading the
# number between two blocks): its blocks go inline, which costs compile time, never numbers.


def _last_node() -> Optional[torch.fx.Node]:
    """The last node of the graph Dynamo is building now (None outside a trace)."""
    tx = getattr(torch._dynamo.symbolic_convert.tls, "current_tx", None)
    if tx is None:
        return None
    return tx.output.current_tracer.graph._root.prev  # the graph's sentinel where it is empty


def _reads_free_numbers(node_before: Optional[torch.fx.Node]) -> bool:
    """Whether a node after `node_before` is, or uses, a symbolic float or bool with no graph input
    behind it ([Note: Numbers a region cannot take from outside])."""
    if node_before is None:
        return False
    node = node_before.next
    while node.op != "root":
        if any(_free_number(n) for n in (node, *node.all_input_nodes)):
            return True
        node = node.next
    return False


def _free_number(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("example_value"), (torch.SymFloat, torch.SymBool)) and "grapharg" not in node.meta


_VALUE_GUARDS = ("CONSTANT_MATCH", "EQUALS_MATCH")
_ATTRIBUTE_STEP = re.compile(r"\._modules\['([^']+)'\]|\.(\w+)")


def _guard_names() -> frozenset:
    """The names of the value guards Dynamo's trace under way installed so far: (source, kind)."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return frozenset()
    return frozenset((g.name, g.create_fn_name()) for g in context.guards_context.dynamo_guards
                     if g.create_fn_name() in _VALUE_GUARDS)


def _attributes_guarded(name: str, guards: frozenset) -> tuple:
    """The attribute paths below block `name` (its FQN from the root) that `guards` compare by
    value, each as its steps: ("_modules", "self_attn"), ("attr", "layer_idx")."""
    below = "".join(f"._modules['{part}']" for part in name.split("."))
    paths = set()
    for source, _ in guards:
        at = source.find(below)
        if at < 0:
            continue
        rest = source[at + len(below):]
        steps = list(_ATTRIBUTE_STEP.finditer(rest))
        if rest and "".join(m.group(0) for m in steps) == rest:  # nothing but attribute steps
            paths.add(tuple(("_modules", m.group(1)) if m.group(1) is not None else ("attr", m.group(2)) for m in steps))
    return tuple(sorted(paths))


def _values(block: nn.Module, paths: tuple) -> tuple:
    """The values of `paths` (`_attributes_guarded`) on `block`, as their reprs ("-" where one is
    missing)."""
    values = []
    for path in paths:
        value = block
        for how, key in path:
            value = value._modules.get(key) if how == "_modules" else getattr(value, key, None)
            if value is None:
                break
        values.append(repr(value) if value is not None else "-")
    return tuple(values)


def _call_hooks_and_forward(module: nn.Module, args: tuple, kwargs: dict):
    """`nn.Module.__call__`, except that the compiled call `FSDPModule.compile` installed is not
    entered again: it is what runs now, or what the eager helpers below step out of. Those that
    leave the rest of the call to Dynamo (`recursive=False`) spell the same line out: a call
    through this function would be a frame of ours, which Dynamo would trace."""
    call = nn.Module._call_impl if module._fsdp_state.compiled_in_place else nn.Module.__call__
    return call(module, *args, **kwargs)


@functools.partial(torch._dynamo.disable, recursive=False)
def _call_on_eager_hooks(module: nn.Module, args: tuple, kwargs: dict):
    state = module._fsdp_state
    call = nn.Module._call_impl if state.compiled_in_place else nn.Module.__call__
    output = call(module, *args, **kwargs)
    traced.record_fallback(state)  # after the call: a root's first call claims its `ctx`
    return output


# [Note: Compile regions under fully_shard]
# A `torch.compiler.nested_compile_region` is traced once and reused by Dynamo, which needs every
# tensor the region reads to come from a source it can guard. Parameters gathered inside the graph
# have none (Dynamo stops with "Freevar has no source"). So a sharded module whose parameters such a
# region reads is not traced into the step's graph: its call is a graph break (this function is
# disabled for its own frame only), its hooks run on the eager runtime, and Dynamo compiles what
# the call reaches, the module's forward with its regions, as frames of their own, once for every
# block of the same code. That is what torch's fully_shard does for every module under compile; the
# numbers are the eager runtime's. Calls that enclose this one are broken up around it, so the root
# runs on the eager hooks too. tests/test_compile_blocks.py compares with torch's fully_shard.
# Where the region is the forward of the group's one module, the region can take the gathered
# tensors as its arguments instead, and the block stays in the step's graph: [Note: Blocks as
# compile regions] in runtime/traced.py (`FSDPState.traces_as_region`).
@functools.partial(torch._dynamo.disable, recursive=False)
def _call_around_compiled_body(module: nn.Module, args: tuple, kwargs: dict):
    call = nn.Module._call_impl if module._fsdp_state.compiled_in_place else nn.Module.__call__
    return call(module, *args, **kwargs)


@functools.partial(torch._dynamo.disable, recursive=False)
def _call_in_block_scope(module: nn.Module, args: tuple, kwargs: dict):
    state = module._fsdp_state
    state.calling_in_block_scope = True  # its eager hooks are the plan, not a fallback
    try:
        with state.owner_checks_lifted():  # [Note: Owner checks in block scope] in runtime/state.py
            call = nn.Module._call_impl if state.compiled_in_place else nn.Module.__call__
            return call(module, *args, **kwargs)
    finally:
        state.calling_in_block_scope = False


traced.skip_own_frame(_call_on_eager_hooks, _call_around_compiled_body, _call_in_block_scope)


# Distinct region bodies Dynamo keeps for `_forward_region` in one trace, all kinds of block
# together (torch raises beyond it; its default is 8): [Note: Blocks as compile regions].
_REGION_ENTRIES = 4096


@torch.compiler.nested_compile_region(max_reuse_entries=_REGION_ENTRIES)
def _forward_region(module: nn.Module, every_block: bool, layout: str, *leaves):
    """A block's forward as one compile region over its gathered parameters ([Note: Blocks as
    compile regions] in runtime/traced.py): one function for every block, so that Dynamo compares
    each block's body with those it traced before and keeps one copy of each distinct body. The
    arguments come flat, `layout` telling how to rebuild them (`_flat_call`)."""
    state = module._fsdp_state
    unsharded, args, kwargs = _rebuild(layout, leaves)
    output = _with_owners(module, state.region_owners, 0, unsharded, state.region_body(every_block), args, kwargs)
    return _not_an_input(output, leaves)


def _not_an_input(output, inputs: tuple):
    """The region's output, where it hands back one of its inputs (a block that passes a mask
    through) or a view of one, a copy of it: torch refuses a region whose output aliases an input.
    Tensors at the top level and in a tuple or list; Dynamo traces this once per region body, not
    per block (`_base` is the tensor a view was made from, its root base for a view of a view)."""
    if isinstance(output, torch.Tensor):
        base = output._base
        aliases = any(
            output is value or (base is not None and (base is value or base is value._base))
            for value in inputs if isinstance(value, torch.Tensor)
        )
        return output.clone() if aliases else output
    if type(output) in (tuple, list):
        return type(output)(_not_an_input(value, inputs) if isinstance(value, torch.Tensor) else value for value in output)
    return output


def _with_owners(module: nn.Module, owners: tuple, at: int, unsharded: list, body: Callable, args, kwargs):
    """`body(module, *args, **kwargs)` with the gathered tensors swapped into the owners from
    `owners[at]` on, one owner per nested swap, which Dynamo takes as no side effect ([Note: Blocks
    as compile regions] in runtime/traced.py)."""
    if at == len(owners):
        return body(module, *args, **kwargs)
    path, names = owners[at]
    with torch.nn.utils.stateless._reparametrize_module(module.get_submodule(path), {name: unsharded[i] for name, i in names}):
        return _with_owners(module, owners, at + 1, unsharded, body, args, kwargs)


def _call_as_region(module: nn.Module, layout: str, leaves: list, every_block: bool):
    """The call, its arguments flat (`_flat_call`), as a region over the gathered tensors."""
    state = module._fsdp_state
    unsharded, leaves = traced.region_pre_forward(state, leaves)
    layout = ";".join([str(len(unsharded)), layout]) if layout else str(len(unsharded))
    return traced.region_post_forward(state, _forward_region(module, every_block, layout, *unsharded, *leaves))


# [Note: Every block a compile region]
# `fsdp_graph.backend(regions="blocks")` traces sharded blocks as if their forward were marked
# `torch.compiler.nested_compile_region` ([Note: Blocks as compile regions] in runtime/traced.py),
# with no change to the model's classes: a block that is a group of its own and qualifies there
# (no forward hooks of the user's, no forward set on the instance, plain tensors gathered) runs its
# class's forward as a region, the collectives outside it, once the trace has traced one block of
# its kind inline. The whole step's graph then holds one region body per kind, which Dynamo traces
# once and AOTAutograd once: what each further layer costs is tracing the collectives around it.
# The first block of a kind goes inline because Dynamo refuses a graph break inside a region
# (torch raises): a block that breaks the graph breaks it inline first, and then runs on the eager
# hooks as it would without regions (the trace that continues after the break is a new one, whose
# first block of that kind again goes inline). So the kind holds what a block's code may branch on:
# `kind_of` in runtime/state.py (classes, the Python flags of every submodule: bools, strings, None,
# enums; parameter shapes), read from the block at the call, and the layout of the call's
# arguments. Blocks that differ there (Gemma's sliding and global layers) are kinds apart, each
# with its first block inline. Numbers join the kind only where the kind's first block's trace
# guarded on them ([Note: Numbers a block's trace guarded on]): a layer index differs in every
# block, and most code never reads it. A later block whose code branches on global state, or on a
# number passed in as an argument, into a graph break still meets torch's error inside its region,
# which Dynamo raises out of the compiled call before any code of ours runs. Torch refuses outputs
# that alias inputs: an input handed back as it is, or a view of one, gets copied
# (`_not_an_input`). What AOTAutograd refuses in a region, a buffer or input changed in place,
# compiles inline instead: [Note: Regions that do not compile] in fsdp_graph/compile/backend.py.
# Region blocks reshard after forward, stay unsharded, or are kept by a memory budget's selective
# unsharding as inline blocks are (tests/test_compile_blocks.py).
# `_seen` keeps its record per trace: Dynamo runs it as plain Python while tracing
# (`assume_constant_result`), and a restarted trace (a graph break found) starts a new record.


# [Note: Flat region arguments]
# Dynamo flattens a region's arguments to compare calls; nested ones (a list of tensors, a dict of
# keyword arguments) go through pytree, whose traced code costs every call and leaves a guard on
# pytree's registry that torch 2.13 cannot serialize (fsdp_graph.precompile then gives up). So the
# gathered tensors and the call's arguments go in flat, with a string constant that says how to
# rebuild them: "n;a:;a2:;k:name;k2:name" = n gathered tensors, a positional leaf, a positional
# tuple of 2 leaves, a keyword leaf, a keyword tuple of 2 leaves. Leaves are tensors and Python
# scalars; anything else (a cache object, a nested structure) goes in as it is, as "oa:" or "ok:name".


_LEAF_TYPES = (torch.Tensor, bool, int, float, str, type(None))


def _flat_call(args: tuple, kwargs: dict) -> tuple[str, list]:
    """A call's arguments as (the layout of their fields, the leaves); the region's layout puts the
    number of gathered tensors first. One loop with no calls of ours in it: Dynamo steps through it
    at every block's call."""
    fields, leaves = [], []
    values, names, positional = (*args, *kwargs.values()), ("",) * len(args) + tuple(kwargs), len(args)
    for i in range(len(values)):
        value, kind = values[i], "a" if i < positional else "k"
        if isinstance(value, _LEAF_TYPES):
            fields.append(f"{kind}:{names[i]}")
            leaves.append(value)
            continue
        flat = type(value) is tuple
        if flat:
            for item in value:
                flat = flat and isinstance(item, _LEAF_TYPES)
        if flat:
            fields.append(f"{kind}{len(value)}:{names[i]}")
            leaves.extend(value)
        else:
            fields.append(f"o{kind}:{names[i]}")
            leaves.append(value)
    return ";".join(fields), leaves


def _rebuild(layout: str, leaves: tuple) -> tuple[list, list, dict]:
    fields = layout.split(";")
    n = int(fields[0])
    unsharded, args, kwargs, at = list(leaves[:n]), [], {}, n
    for field in fields[1:]:
        kind, _, name = field.partition(":")
        count = kind.lstrip("oak")
        if count:
            value, at = tuple(leaves[at:at + int(count)]), at + int(count)
        else:
            value, at = leaves[at], at + 1
        if "a" in kind:
            args.append(value)
        else:
            kwargs[name] = value
    return unsharded, args, kwargs


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
