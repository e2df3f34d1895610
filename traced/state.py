"""A sharded module's state where its calls may be traced: the eager runtime's `FSDPState`,
`ParamGroup` and `RootContext`, each extended with what a compiled call needs. `fully_shard` makes
these; the eager runtime knows nothing of them and runs its own hooks as it always does.

- `TracedState`: while Dynamo traces, its forward hooks gather the group into the graph
  (traced/hooks.py); when Dynamo runs a call in Python inside a compiled call, they note the
  fallback and run the eager hooks in the graph's order ([Note: Fallback to the eager hooks]). It
  knows whether its block may be traced as a compile region (traced/regions.py) and why its group
  must stay on the eager hooks.
- `TracedGroup`: the gradient-flags leaf a compiled backward reduces with the gradients
  ([Note: Gradient flags in a graph] in traced/unshard.py).
- `TracedRootContext`: what the root's compiled calls share: the fallbacks seen, the compile
  callbacks' findings (traced/callbacks.py), the frames' wire orders.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from ..runtime.multi_mesh_group import MultiMeshGroup, mesh_groups
from ..runtime.param_group import ParamGroup, ShardedState
from ..runtime.owner_check import OwnerCheck
from ..runtime.state import FSDPState, RootContext, _in_backward, raise_materialization_problem
from ..runtime.wire_plan import Replay, WirePlan
from . import callbacks, hooks
from .regions import own_region_forward, region_reading_reason
from .unshard import finish_at_backward_end, new_flags_leaf, track_gradient_flags

logger = logging.getLogger(__name__)


class TracedRootContext(RootContext):
    """What every state under one root shares, with what its compiled calls need."""

    def __init__(self, root: "TracedState", states: list["TracedState"], device: torch.device) -> None:
        super().__init__(root, states, device)
        # Graphs are being captured, not run (fsdp_graph.predict): parameters on the meta device are
        # expected then. Set by `capturing_graphs`.
        self.capturing = False
        # State name -> why its hooks ran eagerly inside a compiled call; see traced/hooks.py.
        self.fallbacks: dict[str, str] = {}
        # The call checks lifted while Dynamo compiles: [Note: Owner checks while compiling].
        self.checks_lifted_for_compile: list[OwnerCheck] = []
        # What `check_materialized` found before the latest trace began, raised by the traced root:
        # [Note: Tracing reads what was followed].
        self.problem_before_trace: Optional[tuple[str, Any]] = None
        # The wire orders of the compiled frames whose calls this root makes, by frame (set by the
        # backend), for a step on the eager hooks to keep: [Note: A fallback keeps the frame's wire
        # order] in runtime/wire_plan.py.
        self.wire_plans: dict[Any, WirePlan] = {}
        callbacks.follow_before_compiling(self)

    def replay_for_fallback(self) -> Optional[Replay]:
        """For a root call that runs on the eager hooks inside a compiled call: the compiled frame's
        wire order to keep, if one frame's is known ([Note: A fallback keeps the frame's wire order]).
        None where a group stays on the hooks by a setting of the user's (`eager_only_reason`: no
        sync, comm hooks, ...): every rank has it, so no rank runs the graph, and the hooks do
        what the setting asks."""
        plans = set(self.wire_plans.values())
        if len(plans) != 1 or not torch.is_grad_enabled() or self.root.eager_only_reason() is not None:
            return None
        (plan,) = plans
        groups = {g.name: g for s in self.states if s.group is not None for g in mesh_groups(s.group)}
        shared = plan.others & {name for group in groups.values() for name in group.parallelism_names()}
        if shared:
            logger.warning("fsdp_graph: the root's call runs on the eager hooks where its compiled graph ran before, "
                           "and the graph holds collectives of its own on the groups' process groups (%s), which "
                           "the hooks cannot place: they issue their own order ([Note: A fallback keeps the "
                           "frame's wire order])", ", ".join(sorted(shared)))
            return None
        logger.info("fsdp_graph: the root's call runs on the eager hooks where its compiled graph ran before; "
                    "its collectives keep the graph's order ([Note: A fallback keeps the frame's wire order])")
        return Replay(plan, groups)


class TracedGroup(ParamGroup):
    """A `ParamGroup` whose backward may run in a compiled graph."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The flags a compiled backward reduces with the gradients; see traced/unshard.py.
        self.grad_flags: Optional[torch.Tensor] = None
        track_gradient_flags(self)

    def compiled_grads_handed_out(self) -> None:
        finish_at_backward_end(self)  # [Note: Flags that need no reading] in traced/unshard.py

    def follow_registered_params(self) -> None:
        """As the eager group's, and the flags leaf moves to where the shards are now."""
        super().follow_registered_params()
        if self.state is not ShardedState.UNSHARDED and self.grad_flags.device != self.params[0].local_shard.device:
            new_flags_leaf(self)


class TracedState(FSDPState):
    """An `FSDPState` whose module's calls may be traced by Dynamo."""

    root_context_type = TracedRootContext

    def __init__(self, modules: tuple[nn.Module, ...], group: Optional[TracedGroup], *args, **kwargs) -> None:
        super().__init__(modules, group, *args, **kwargs)
        self._traced_num_forwards = 0  # modules of this call whose traced forward began: traced/hooks.py
        # Set while a compiled call runs this module on the eager hooks by choice (the backend's
        # `scope="block"`, [Note: Compile scope] in traced/scope.py): not a fallback.
        # The root's flag covers every module its call runs, those Dynamo never sees too (a block
        # inside `torch.utils.checkpoint`, which Dynamo runs in Python once the break stops it).
        self.calling_in_block_scope = False
        # Set by fully_shard where a torch.compiler.nested_compile_region reads this group's
        # parameters: compiled calls run the hooks eagerly around a body Dynamo compiles on its own.
        # See [Note: Compile regions under fully_shard] in traced/call.py.
        self.hooks_around_compiled_body = region_reading_reason(modules, group)
        # The unwrapped forward, where the module's own forward is such a region: traced as one
        # inside the step's graph when `traces_as_region()` ([Note: Blocks as compile regions]).
        self.region_forward = own_region_forward(modules)
        # For a traced region: each submodule of the module holding this group's parameters, by its
        # path under the module, with (attribute, parameter index) pairs: plain constants, so that
        # Dynamo can reuse one block's region for the next ([Note: Blocks as compile regions] in
        # traced/regions.py). And a number by which a traced call names this state to plain Python
        # (`region_state`), which tells the block's kind ([Note: Every block a compile region]).
        self.region_owners = owners_by_path(modules[0], group) if group is not None and len(modules) == 1 else None
        self.region_id = None
        if self.region_owners is not None:
            self.region_id = next(_region_ids)
            _region_states[self.region_id] = self
        # Set by `FSDPModule.compile`: the module's compiled call is its whole `__call__`.
        self.compiled_in_place = False
        hooks.trace_hooks_inside_checkpoint()

    # -- the hooks: traced, or the eager runtime's ------------------------------------------------

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if torch.compiler.is_compiling():
            return hooks.pre_forward(self, module, args, kwargs)
        self._fell_back = hooks.in_compiled_call() and not self._within_block_scope()
        if self._fell_back:
            hooks.record_fallback(self)
        return super()._pre_forward_hook(module, args, kwargs)

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any):
        if torch.compiler.is_compiling():
            return hooks.post_forward(self, module, output)
        output = super()._post_forward_hook(module, args, output)
        if self.is_root and not _in_backward() and self._num_forwards_done >= len(self.modules):
            hooks.close_partly_run_groups(self)  # [Note: Groups whose forward ran partly in a graph]
        return output

    def _root_pre_forward(self) -> None:
        callbacks.ensure_compile_callbacks()  # [Note: Compile callbacks outlive a Dynamo reset]
        super()._root_pre_forward()
        if self._fell_back:
            self.ctx.replay = self.ctx.replay_for_fallback()

    def check_materialized(self) -> None:
        """As the eager state's; a traced root raises what the check found before the trace began
        ([Note: Tracing reads what was followed] in traced/callbacks.py): a check per parameter,
        traced, cost every layer's share of tracing again."""
        if not torch.compiler.is_compiling():
            return super().check_materialized()
        callbacks.followed_for_this_trace()  # [Note: Compile callbacks outlive a Dynamo reset]
        if self.ctx.parameters_replaced < 0:  # never; read so that the graph guards the count
            raise ValueError("parameters_replaced went negative")
        problem = self.ctx.problem_before_trace
        if problem is not None and not self.ctx.capturing:
            raise_materialization_problem(problem)

    @contextlib.contextmanager
    def owner_checks_lifted(self) -> Iterator[None]:
        """This group's submodules without their call check (`_check_called_through_group`) for
        the duration: a call of the group runs them, where the check never fires anyway.

        [Note: Owner checks in block scope]
        Under `scope="block"` a group's call runs its hooks eagerly and Dynamo compiles its forward
        frame. Dynamo also compiles, as a graph of its own, the forward of an inbuilt module
        (`torch.nn.Embedding`, ...) that has a forward hook, where it meets that module running in
        a frame it does not trace (torch/_dynamo/trace_rules.py: "inbuilt nn.Module.forward allowed
        - module has hooks"): HF's LlamaModel.forward breaks in its loop over the layers, so its
        embedding ran as a graph of its own under us and eagerly under FSDP2, each step (a graph
        call per step and a compile at the cold start more than FSDP2; docs/benchmarks.md).
        So the group's call lifts the checks for its duration, and puts them back after."""
        lifted = self.lift_owner_checks()
        try:
            yield
        finally:
            for check in lifted:
                check.restore()

    def eager_only_reason(self) -> Optional[str]:
        """Why this state's compiled calls must run on the eager hooks, or None. See [Note: Groups
        that stay on the eager hooks] in traced/hooks.py.

        The root answers for every group under it: its call's frame encloses theirs, so a reason
        anywhere sends the whole call to the eager hooks. Any other state answers for its own group,
        but while Dynamo traces inside a root call whose traced forward began, where the root has
        asked for every group, with guards on what it read: there it answers None at once (in
        eager code, a fallback's log among them, it always answers for its group). A block
        compiled on its own holds only its group. (Asking every group at every module call made
        tracing a step quadratic in the number of groups; asking a block's own group again cost
        Dynamo as many steps per layer as the block's gather.)"""
        if (torch.compiler.is_compiling() and self.ctx is not None and not self.is_root
                and self.ctx.root._traced_num_forwards > 0):
            return None
        for state in self.ctx.states if self.ctx is not None and self.is_root else [self]:
            reason = state.group.eager_only_reason() if state.group is not None else None
            if reason is not None:
                return reason
        return None

    def _within_block_scope(self) -> bool:
        """Whether this module runs under a call in block scope: its own, or its root's."""
        return self.calling_in_block_scope or (self.ctx is not None and self.ctx.root.calling_in_block_scope)

    def region_body(self, every_block: bool) -> Optional[Callable]:
        """The function a traced call of this state's module runs as a compile region, or None: the
        forward the user marked as one, or with `every_block` the forward of any block
        ([Note: Blocks as compile regions] in traced/regions.py)."""
        if self.region_forward is not None or not every_block or len(self.modules) != 1:
            return self.region_forward
        module = self.modules[0]
        return None if "forward" in module.__dict__ else type(module).forward  # not a forward patched on the instance

    def traces_as_region(self, every_block: bool = False) -> bool:
        """Whether a traced call of this state's module runs its forward as a compile region: see
        [Note: Blocks as compile regions] in traced/regions.py."""
        if self.region_body(every_block) is None or self.is_root or self.group is None or len(self.modules) != 1:
            return False
        module = self.modules[0]
        if len(module._forward_pre_hooks) != 1 or len(module._forward_hooks) != 1:
            return False  # hooks of the user's, which the region would skip
        if nn.modules.module._global_forward_pre_hooks or nn.modules.module._global_forward_hooks:
            return False
        if isinstance(self.group, MultiMeshGroup) or self.group.layout.as_bytes or self.group.has_tp:
            return False  # tensor-parallel DTensors and extension subclasses: no region inputs (Dynamo fails)
        if self.region_owners is None:
            return False  # a parameter held outside the module
        return owns_its_submodules(self.region_id)


# Dynamo inlines these hooks when it traces a module call, and runs them eagerly (the fallback) when
# it runs the call itself. See [Note: Fallback to the eager hooks] in traced/hooks.py.
hooks.skip_when_not_inlined(
    TracedState._pre_forward_hook, TracedState._post_forward_hook, FSDPState._check_called_through_group
)


def owners_by_path(module: nn.Module, group: ParamGroup) -> Optional[tuple[tuple[str, tuple[tuple[str, int], ...]], ...]]:
    """The owners of `group`'s parameters by their path under `module`, or None where one lies
    outside it."""
    paths = {id(m): path for path, m in module.named_modules()}
    owners: dict[str, list[tuple[str, int]]] = {}
    for owner, name, i in group.owner_slots:
        if id(owner) not in paths:
            return None
        owners.setdefault(paths[id(owner)], []).append((name, i))
    return tuple((path, tuple(slots)) for path, slots in owners.items())


_region_ids = itertools.count()
_region_states: "weakref.WeakValueDictionary[int, TracedState]" = weakref.WeakValueDictionary()


def region_state(region_id: int) -> Optional[TracedState]:
    """The state whose `region_id` this is, while it lives."""
    return _region_states.get(region_id)


@torch._dynamo.assume_constant_result
def owns_its_submodules(region_id: int) -> bool:
    """Whether no submodule of the module of the state `region_id` names belongs to another state.
    Plain Python while Dynamo traces: stepping through the walk over every block's submodules
    was the largest part of Dynamo's trace of a layer. No guard keeps the answer: `fully_shard`
    refuses a submodule whose parameters a parent's group holds, so only a submodule without
    parameters, sharded after a graph was compiled, goes unseen by that graph."""
    state = region_state(region_id)
    return state is not None and all(getattr(m, "_fsdp_state", state) is state for m in state.modules[0].modules())


@contextlib.contextmanager
def capturing_graphs(module: nn.Module) -> Iterator[None]:
    """While tracing `module` (a `fully_shard` root) only to capture its graphs, as
    fsdp_graph.predict does on the meta device: no check for parameters left on meta."""
    ctx = module._fsdp_state.ctx
    ctx.capturing = True
    try:
        yield
    finally:
        ctx.capturing = False
