"""Per-`fully_shard` state and the hooks that drive a group through forward and backward.

One `FSDPState` per `fully_shard` call. Each call claims every state below its modules, so after the
usual bottom-up wrapping the outermost call is the root: it shares one `RootContext` (streams,
forward order) with all states below it. Roots are known before the first forward, eager or traced.

Per step, for each state:
    pre-forward     unshard (wait), prefetch the next groups named by `set_modules_to_forward_prefetch`
    post-forward    reshard as `reshard_after_forward` says; hook the outputs for pre-backward
    pre-backward    unshard again if resharded, prefetch the group that ran before this one in forward
    post-backward   when every trainable parameter's gradient accumulated: reduce-scatter, reshard
    final callback  (root) reduce what is left, wait for all reduce-scatters, reset
"""

from __future__ import annotations

import logging
from enum import Enum, auto
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from .collectives import CommContext
from .param import MetaParameterError
from .owner_check import OwnerCheck
from .param_group import ParamGroup, ShardedState
from .policies import MixedPrecisionPolicy
from .trees import cast_floats, map_tensors, tensors_in
from .wire_plan import Replay

logger = logging.getLogger(__name__)


class TrainingState(Enum):
    """Where a state is in the current step."""

    IDLE = auto()  # at construction, after post-forward, and after the backward's final callback
    FORWARD = auto()  # from pre-forward to post-forward
    BACKWARD = auto()  # from the first gradient reaching this state's outputs to the final callback


class RootContext:
    """What every state under one root shares."""

    def __init__(self, root: "FSDPState", states: list["FSDPState"], device: torch.device) -> None:
        self.root = root
        self.states = states  # module order, root first
        self.comm = CommContext(device)
        self.forward_order: list[FSDPState] = []  # states by first pre-forward this step
        self.final_callback_queued = False
        self.is_last_backward = True
        self.materialized = False  # every parameter was seen off the meta device (checked until then)
        # `backward_writes_param_grads`' answer for the current backward, None until asked.
        self._writes_param_grads: Optional[bool] = None
        # Sharded parameters that modules registered anew (`module.w = nn.Parameter(...)`), counted:
        # a compiled step guards the count, so a replacement recompiles ([Note: The sharded
        # parameter is the one its module holds] in runtime/param.py).
        self.parameters_replaced = 0
        # The order of collectives a step on these hooks keeps, where the layer above gives one
        # ([Note: A fallback keeps the frame's wire order] in runtime/wire_plan.py).
        self.replay: Optional[Replay] = None
    def note_parameter_replaced(self) -> None:
        self.parameters_replaced += 1

    def backward_writes_param_grads(self) -> bool:
        """Whether the running backward accumulates into the `.grad` of any trainable parameter
        under this root. See [Note: A backward that writes no parameter gradient]."""
        if self._writes_param_grads is None:
            self._writes_param_grads = not _in_backward() or any(
                _will_accumulate(p.unsharded_param)
                for state in self.states
                if state.group is not None
                for p in state.group.params
                if p.unsharded_param is not None and p.unsharded_param.requires_grad
            )
        return self._writes_param_grads

    def reduce_ready_groups(self) -> None:
        """Reduce-scatter, in reverse forward order, the groups whose gradients are all here, up to
        the first that is still waiting for one.

        [Note: One order of reduce-scatters on every rank]
        Collectives must come in the same order on every rank. A group's gradients can all be
        here on one rank and not on another (ranks using different parameters, or a parameter used
        on some ranks only), so reducing each group as soon as its own gradients arrive could pair
        one rank's group with another rank's. Groups are reduced in reverse forward order instead,
        which every rank shares; a group still waiting for a gradient holds back the groups that ran
        before it until the backward's final callback. In the usual backward gradients complete in
        exactly that order, so nothing waits. Frozen groups reduce nothing and never hold others back.
        """
        for state in reversed(self.forward_order):
            group = state.group
            if group is None or group.reduced_this_backward or group.num_trainable == 0:
                continue
            if not group.all_grads_ready:
                return
            if self.replay is not None:
                self.replay.reduce(group)
            else:
                group.post_backward()

class _InputGradsDone(torch.autograd.Function):
    """The identity on a forward call's inputs; its backward tells the group that the call's
    backward reached them. See [Note: Frozen parameters outlive the gradients]."""

    @staticmethod
    def forward(ctx, group: ParamGroup, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        ctx.group.input_grads_done()
        return (None, *grads)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# [Note: A backward that writes no parameter gradient]
# FSDP2 reduce-scatters only the parameters that got a gradient and skips a group where none did.
# We cannot decide that from one rank's gradients: ranks may use different parameters, and a rank
# whose parameters of a group got no gradient still joins the reduce-scatter of a rank whose did
# ([Note: Every rank packs every parameter] in runtime/collectives.py). The criterion must read
# the same on every rank without a collective, and one does: whether this backward writes the
# `.grad` of any parameter at all. `torch.autograd.grad(loss, inputs=[x])` and
# `loss.backward(inputs=[x])` tell the engine which leaves to produce gradients for, and it marks
# every other gradient accumulator not to run; every rank passes the same inputs. So when a group
# with no gradient on this rank is about to reduce, the root asks the engine once per backward
# (`torch._C._will_engine_execute_node`) whether it runs the accumulator of any trainable
# unsharded parameter under the root. If it runs none, no group reduce-scatters or all-reduces,
# and every `.grad` stays as it was, as in torch; the next backward reduces as usual. An ordinary
# `backward()` runs the accumulator of every parameter its forward used, so it answers yes on
# every rank whose forward used a trainable parameter (any real loss does), and the groups reduce
# as always. A group that holds gradients of earlier backwards (accumulated without sync, or HSDP
# sums kept without the all-reduce) reduces them as usual. Not covered: a backward whose explicit
# inputs are unsharded parameters taken from inside forward, used on some ranks only.
# A graph cannot skip: see [Note: Gradient flags in a graph] in traced/unshard.py.


def _will_accumulate(param: torch.Tensor) -> bool:
    """Whether the running backward will accumulate a gradient into `param.grad`."""
    try:
        return torch._C._will_engine_execute_node(get_gradient_edge(param).node)
    except RuntimeError:  # `param` is an input of torch.autograd.grad: captured, never accumulated
        return False


class FSDPState:
    """Hooks and training state of one `fully_shard` call over one or more modules."""

    root_context_type = RootContext  # what `claim_root` makes: a subclass may extend it

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: Optional[ParamGroup],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward,
        device: torch.device,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.device = device
        self.reshard_after_forward = reshard_after_forward  # as given; None means "root: False"
        self.training_state = TrainingState.IDLE
        self.ctx: Optional[RootContext] = None
        self.is_root = False
        self.name = type(modules[0]).__name__
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: Optional[list[FSDPState]] = None  # None: implicit
        self._num_forwards_done = 0  # modules of this call whose forward finished this step
        self._modules_in_forward: set[nn.Module] = set()  # modules of this call that entered forward
        # A backward since this call's last forward reduced its group: [Note: Backwards that do not
        # reach a group again].
        self._reduced_since_forward = False
        # This step's forward on these hooks keeps the order another path issues (set by the
        # layer above, traced/state.py): no prefetch, full reshard, reduce at the inputs.
        self._fell_back = False
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook)
            module.register_state_dict_pre_hook(self._reshard_for_state_dict)
            module.register_load_state_dict_pre_hook(self._check_and_reshard_for_load_state_dict)
            module.register_load_state_dict_post_hook(self._follow_loaded_params)
        # Each submodule holding this group's parameters, with its call check's handle: see
        # `_check_called_through_group` and `owner_checks_lifted`.
        self._owner_checks = [OwnerCheck(owner, self._check_called_through_group) for owner in self._owners_inside_group()]

    # -- root --------------------------------------------------------------------------------

    def claim_root(self) -> None:
        """Make this state the root of every state below its modules (called by `fully_shard`)."""
        names: dict[FSDPState, list[str]] = {}
        states: list[FSDPState] = []
        for root_module in self.modules:
            for fqn, module in root_module.named_modules():
                state = getattr(module, "_fsdp_state", None)
                if isinstance(state, FSDPState):
                    if state not in names:
                        states.append(state)
                        names[state] = []
                    names[state].append(fqn or "<root>")
        self.ctx = self.root_context_type(self, states, self.device)
        for state in states:
            state.ctx = self.ctx
            state.is_root = state is self
            state.name = ", ".join(names[state])
            if state.reshard_after_forward is None:
                state_raf = not state.is_root
            else:
                state_raf = state.reshard_after_forward
            if state.group is not None:
                state.group.name = state.name
                state.group.comm = self.ctx.comm
                state.group.on_all_grads_ready = self.ctx.reduce_ready_groups
                state.group.backward_writes_param_grads = self.ctx.backward_writes_param_grads
                for p in state.group.params:
                    p.on_replaced = self.ctx.note_parameter_replaced
                state.group.set_reshard_after_forward(state_raf)
        logger.debug("fsdp_graph::claim_root (%s) states=%d", self.name, len(states))

    # -- forward -------------------------------------------------------------------------------

    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        if _in_backward():
            # Recomputation under activation checkpointing: the group was gathered in pre-backward.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        if self.training_state is TrainingState.FORWARD and module not in self._modules_in_forward:
            self._modules_in_forward.add(module)  # a second module of fully_shard([a, b])
            return self._prepare_inputs(args, kwargs)
        if self.is_root:
            self._root_pre_forward()
            if self.device.type != "cpu":  # as FSDP2's root: inputs go where the parameters are
                args, kwargs = tree_map(
                    lambda x: x.to(self.device) if torch.is_tensor(x) else x, (args, kwargs)
                )
        with torch.profiler.record_function(f"fsdp_graph::pre_forward ({self.name})"):
            logger.debug("fsdp_graph::pre_forward (%s)", self.name)
            self.training_state = TrainingState.FORWARD
            self._modules_in_forward = {module}
            self._reduced_since_forward = False
            if self not in self.ctx.forward_order:
                self.ctx.forward_order.append(self)
            if self.group is not None:
                self._unshard()
                self.group.wait_for_unshard()
            for target in self.forward_prefetch if not self._fell_back else ():
                if target.group is not None:
                    target.group.unshard(async_op=True)
            args, kwargs = self._prepare_inputs(args, kwargs)
        return args, kwargs

    def _prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """What every module call of this state does to its inputs, each module of
        `fully_shard([a, b])` too: cast them (`cast_forward_inputs`), and, for a group with frozen
        parameters, hold its reshard until their gradients are computed ([Note: Frozen parameters
        outlive the gradients] in runtime/param_group.py), and for a call that fell back inside a
        compiled call, reduce when its backward reaches them ([Note: A fallback group's backward
        ends at its inputs])."""
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floats((args, kwargs), self.mp_policy.param_dtype)
        group = self.group
        if group is None or not torch.is_grad_enabled() or (group.num_trainable == len(group.params) and not self._fell_back):
            return args, kwargs
        needing_grad = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
        if not needing_grad:
            return args, kwargs
        group.expect_input_grads(reduces_at_inputs=self._fell_back)
        hooked = dict(zip(map(id, needing_grad), _InputGradsDone.apply(group, *needing_grad)))
        return map_tensors(lambda t: hooked.get(id(t), t), (args, kwargs))

    def follow_registered_params(self) -> None:
        """Root only: every group under this root takes the sharded parameters its modules hold
        now ([Note: The sharded parameter is the one its module holds] in runtime/param.py)."""
        for state in self.ctx.states:
            if state.group is not None:
                state.group.follow_registered_params()

    def check_materialized(self) -> None:
        """Root only: raise once, naming every parameter under this root that is still on the meta
        device, or that was replaced by a tensor that cannot be its shard. Checked until a forward
        passed."""
        if self.ctx.materialized:
            return
        problem = self.materialization_problem()
        if problem is None:
            self.ctx.materialized = True
            return
        raise_materialization_problem(problem)

    def materialization_problem(self) -> Optional[tuple[str, Any]]:
        """Root only: ("replaced", the message) where parameters were replaced by tensors that cannot
        be their shards, ("meta", their names) where parameters are still on the meta device, else
        None."""
        params = [p for s in self.ctx.states if s.group is not None for p in s.group.params]
        replaced = [p for p in params if p.replacement() is not None]
        if replaced:
            names = self._names_under_root(replaced)
            problems = [p.replacement_problem(p.replacement(), name) for p, name in zip(replaced, names)]
            problems = [problem for problem in problems if problem is not None]
            if problems:
                return "replaced", (
                    "Parameters replaced after fully_shard cannot be its shards:\n"
                    + "\n".join(f"  - {problem}" for problem in problems)
                )
        on_meta = [p for p in params if p.sharded_param.is_meta]
        if not on_meta:
            return None
        order = self._parameter_order()
        return "meta", tuple(sorted(self._names_under_root(on_meta), key=lambda name: order.get(name, len(order))))

    def _parameter_order(self) -> dict[str, int]:
        """Each parameter name under this root, with its place in `named_parameters()`."""
        names = {}
        for index, module in enumerate(self.modules):
            prefix = f"[{index}]." if len(self.modules) > 1 else ""
            for name, _ in module.named_parameters():
                names.setdefault(prefix + name, len(names))
        return names

    def _names_under_root(self, params: list) -> list[str]:
        """The names of `params` (ShardedParams), in the order given, as the root's
        `named_parameters` gives them."""
        names = {}
        for index, module in enumerate(self.modules):
            prefix = f"[{index}]." if len(self.modules) > 1 else ""
            for name, param in module.named_parameters():
                names.setdefault(id(param), prefix + name)
        return [names.get(id(p.replacement() if p.replacement() is not None else p.sharded_param), p.fqn) for p in params]

    def _root_pre_forward(self) -> None:
        self.check_materialized()
        self.follow_registered_params()  # FSDP2's lazy init takes replaced parameters here too
        # Gradients of the last step must be final before parameters are read again, and a
        # forward or backward that raised must not leave groups gathered or states half-way.
        self.ctx.comm.finish_reduce_scatters()
        for state in self.ctx.states:
            if state.training_state is not TrainingState.IDLE:
                state._reset_after_error()
            state._num_forwards_done = 0
        self.ctx.forward_order.clear()
        self.ctx.final_callback_queued = False
        self.ctx._writes_param_grads = None
        self.ctx.replay = None

    def _unshard(self) -> None:
        """Gather this group where the hooks need it: now, or where a replayed plan has it."""
        if self.ctx.replay is not None:
            self.ctx.replay.gather(self.group)
        else:
            self.group.unshard()

    def reset_iter_state(self) -> None:
        """Root only: after a forward or backward raised, drop everything of that iteration.

        In-flight reductions end and their gradients are dropped, as are gradients accumulated
        without sync and HSDP sums kept without the all-reduce; every group is resharded.
        """
        ctx = self.ctx
        ctx.comm.discard_reduce_scatters()
        for state in ctx.states:
            state._reset_after_error()
            state._num_forwards_done = 0
            if state.group is not None:
                state.group.holds_unreduced_grads = False
                state.group.reduce_controls.partial = None
        ctx.forward_order.clear()
        ctx.final_callback_queued = False
        ctx.replay = None

    def _reset_after_error(self) -> None:
        logger.debug("fsdp_graph::reset (%s) from %s", self.name, self.training_state.name)
        if self.group is not None:
            self.group.reshard()
            self.group.reset_backward_state()
            for p in self.group.params:  # partial gradients of a backward that raised
                if p.unsharded_param is not None:
                    p.unsharded_param.grad = None
                p.unreduced_grad = None
        self.training_state = TrainingState.IDLE

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any):
        if _in_backward():
            return output
        with torch.profiler.record_function(f"fsdp_graph::post_forward ({self.name})"):
            logger.debug("fsdp_graph::post_forward (%s)", self.name)
            self._num_forwards_done += 1
            if self.mp_policy.output_dtype is not None:
                output = cast_floats(output, self.mp_policy.output_dtype)
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward, mode="any")
            if self._num_forwards_done >= len(self.modules):
                if self.group is not None:
                    if tensors and self.ctx.replay is not None:
                        self.ctx.replay.after_forward(self.group)
                    elif tensors:
                        # Keeping another path's order: backward re-gathers from the whole shard group.
                        self.group.post_forward_reshard(full=self._fell_back)
                    else:
                        # No backward will read these parameters (no_grad, eval): keep none of
                        # them, so an optimizer step before the next forward is never missed.
                        self.group.reshard()
                if self.is_root and self.ctx.replay is not None:
                    self.ctx.replay.end_forward()
                self.training_state = TrainingState.IDLE
        return output

    # -- backward ------------------------------------------------------------------------------

    def _pre_backward(self, *_unused) -> None:
        if self.training_state is TrainingState.BACKWARD:
            return
        ctx = self.ctx
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(ctx.root._post_backward_final)
        with torch.profiler.record_function(f"fsdp_graph::pre_backward ({self.name})"):
            logger.debug("fsdp_graph::pre_backward (%s)", self.name)
            self.training_state = TrainingState.BACKWARD
            if self.group is not None and self.group.unshard_in_backward:
                self._unshard()
                self.group.wait_for_unshard()
            for target in self._backward_prefetch_targets():
                if target.group is not None and target.group.unshard_in_backward:
                    target.group.unshard(async_op=True)

    def _backward_prefetch_targets(self) -> list["FSDPState"]:
        if self._fell_back:
            return []  # as the group that runs next: it prefetches nothing either
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.ctx.forward_order
        if self in order and order.index(self) > 0:
            return [order[order.index(self) - 1]]
        return []

    def finish_backward(self) -> None:
        """What the end of a backward does, on demand, for the whole root: reduce the gradients not
        yet reduced, wait for the reduce-scatters, reshard as `reshard_after_backward` says. For
        drivers that run several backwards and reduce once themselves (fsdp_graph/api/pipelining.py)."""
        self.ctx.root._post_backward_final()

    def discard_gradients(self) -> None:
        """Reshard every group under this root and drop its gradients, reduced or not (a backward
        run only to learn shapes, e.g. a pipeline schedule's metadata inference)."""
        for state in self.ctx.states:
            state._reset_after_error()
            if state.group is not None:
                state.group.holds_unreduced_grads = False
                for p in state.group.params:
                    p.sharded_param.grad = None

    # [Note: Backwards that do not reach a group again]
    # The final callback reduces every group whose forward ran this step, reached by the backward
    # or not: a group whose output this rank's loss does not use still joins the reduction of a rank
    # whose loss does ([Note: One order of reduce-scatters on every rank]). Several backwards may
    # follow one forward: torchtitan's chunked loss runs one backward per chunk of the detached
    # output through the head, then the body's. The first of them reduces every group as above;
    # a later one skips a group it did not reach (no pre-backward, no gradient here, nothing held
    # unreduced), which an earlier backward since its forward already reduced. So the body's groups
    # reduce twice per step there instead of once per chunk and once more (FSDP2 reduces them once:
    # it skips a group without gradients on this rank, and so hangs where ranks use different
    # groups). The one case this does not keep in step is a later backward whose reach differs
    # between ranks.

    def _not_reached_again(self) -> bool:
        """This backward skips the group: [Note: Backwards that do not reach a group again]."""
        group = self.group
        return (self._reduced_since_forward and self.training_state is not TrainingState.BACKWARD
                and not group.holds_unreduced_grads and not group.reduce_controls.zeros_for_unused
                and not any(p.has_unsharded_grad for p in group.params))

    def _post_backward_final(self) -> None:
        """Root only: runs once when the whole backward finished."""
        ctx = self.ctx
        with torch.profiler.record_function("fsdp_graph::post_backward_final"):
            logger.debug("fsdp_graph::post_backward_final (%s)", self.name)
            if ctx.replay is not None:
                ctx.replay.end_backward()
                ctx.replay = None
            for state in reversed(ctx.forward_order + [s for s in ctx.states if s not in ctx.forward_order]):
                # Groups with unused or frozen parameters never counted all their gradients. A group
                # whose forward did not run on the eager hooks and that was not gathered otherwise
                # (`unshard()`) has nothing to reduce: in a compiled step its graph reduced it,
                # and another rank may have run it on the eager hooks instead
                # ([Note: Fallback groups keep the traced order] in traced/hooks.py).
                if state.group is not None and state in ctx.forward_order and state._not_reached_again():
                    continue
                if state.group is not None and (state in ctx.forward_order or state.group.state is not ShardedState.SHARDED):
                    state.group.post_backward()
                elif state.group is not None and state.group.reduce_controls.zeros_for_unused:
                    state.group.zero_grads_of_unused_group()
            if ctx.is_last_backward:
                ctx.comm.finish_reduce_scatters()
            for state in ctx.states:  # offloaded gradients on their way to pinned host memory
                for p in state.group.params if state.group is not None else ():
                    p.wait_host_copy()
            for state in ctx.states:
                if state.group is not None:
                    state._reduced_since_forward |= state.group.reduced_this_backward
                    if state.group.reshard_after_backward:
                        state.group.reshard()
                    state.group.reset_backward_state()
                state.training_state = TrainingState.IDLE
            ctx.final_callback_queued = False
            ctx._writes_param_grads = None

    # -- state dict ----------------------------------------------------------------------------

    def _reshard_for_state_dict(self, *_args, **_kwargs) -> None:
        # state_dict() must show the DTensor shards. Resharding is safe even between forward and
        # backward: pre-backward gathers into the same storage autograd saved.
        if self.group is not None and not _in_backward():
            self.group.reshard()

    def _check_and_reshard_for_load_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, *_args) -> None:
        """Raise once, naming every key, if `state_dict` cannot be copied into this group's shards."""
        # Every group under this module, nested ones included, so one error names every bad key.
        sharded = {id(p.sharded_param): p for s in self.ctx.states if s.group is not None for p in s.group.params}
        if sharded:
            problems = []
            for name, param in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
                p = sharded.get(id(param))
                value = state_dict.get(name)
                if p is None or value is None or not torch.is_tensor(value):
                    continue
                if value.shape != p.orig_size:
                    problems.append(
                        f"'{name}' has shape {tuple(value.shape)}, the parameter has shape "
                        f"{tuple(p.orig_size)}: the checkpoint is from another model or config"
                    )
                elif not isinstance(value, DTensor):
                    problems.append(
                        f"'{name}' is a plain tensor; the sharded parameter is a DTensor: load full "
                        f"(unsharded) state with torch.distributed.checkpoint.state_dict.set_state_dict("
                        f"model, [], model_state_dict=..., options=StateDictOptions(full_state_dict=True))"
                    )
            if problems:
                raise ValueError(
                    f"load_state_dict into the sharded {type(module).__name__} failed:\n"
                    + "\n".join(f"  - {p}" for p in problems)
                )
        self._reshard_for_state_dict()

    def _follow_loaded_params(self, *_args) -> None:
        # `load_state_dict(assign=True)` put new tensors in place, or swapped them
        # (`torch.__future__.set_swap_module_params_on_conversion`): [Note: The sharded parameter
        # is the one its module holds] in runtime/param.py.
        if self.group is not None:
            self.group.follow_registered_params()

    # -- misuse checks -------------------------------------------------------------------------

    def _owners_inside_group(self) -> list[nn.Module]:
        """Submodules (not the `fully_shard` modules themselves) that hold parameters of this group."""
        if self.group is None:
            return []
        owners: list[nn.Module] = []
        for p in self.group.params:
            for owner, _ in p.owners:
                if all(owner is not m for m in self.modules) and all(owner is not o for o in owners):
                    owners.append(owner)
        return owners

    def lift_owner_checks(self, sole_hooks_only: bool = False) -> list[OwnerCheck]:
        """Remove the call checks (with `sole_hooks_only`, only those that are their module's one
        hook) and return them, for the caller to restore."""
        lifted = [check for check in self._owner_checks if not sole_hooks_only or check.is_only_hook()]
        for check in lifted:
            check.lift()
        return lifted

    def _check_called_through_group(self, module: nn.Module, _args) -> None:
        # A submodule whose parameters belong to this group, called on its own, would see DTensor
        # shards instead of gathered parameters; raise instead of failing deep in an op.
        if (
            torch.compiler.is_compiling()
            or self.training_state is not TrainingState.IDLE
            or self.group.state is ShardedState.UNSHARDED
        ):
            return
        names = [p.fqn for p in self.group.params if any(owner is module for owner, _ in p.owners)]
        raise ValueError(
            f"{type(module).__name__} was called on its own, but its parameters {names} are sharded "
            f"in the fully_shard group of '{self.name}'; call '{self.name}' instead, gather first with "
            f"unshard(), or give it a group of its own: fully_shard(submodule) before fully_shard(parent)"
        )


def raise_materialization_problem(problem: tuple[str, Any]) -> None:
    """Raise what `FSDPState.materialization_problem` found."""
    kind, detail = problem
    raise MetaParameterError(list(detail)) if kind == 'meta' else ValueError(detail)
