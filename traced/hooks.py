"""A sharded module's forward hooks while Dynamo traces its call, and the fallback when it does not.

The traced state (traced/state.py) sends its hooks here while `torch.compiler.is_compiling()`:
pre-forward gathers the group into the graph (traced/unshard.py) and casts the inputs, post-forward
casts the outputs and drops the gathered tensors. When Dynamo runs a module's call in Python
instead, the same hooks run the eager runtime's: [Note: Fallback to the eager hooks].
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..runtime import peer_log
from ..runtime.state import FSDPState
from ..runtime.trees import cast_floats
from .unshard import install, unshard

logger = logging.getLogger(__name__)

def pre_forward(state: FSDPState, module: torch.nn.Module, args: tuple, kwargs: dict):
    """Traced pre-forward: gather the group (once for `fully_shard([a, b])`), cast the inputs.

    `state._traced_num_forwards` counts the modules of the call whose forward began. It is 0 whenever
    a graph is entered (the last post-forward resets it), so Dynamo's guard on it always holds.
    """
    num_forwards = state._traced_num_forwards
    if state.is_root and num_forwards == 0:
        state.check_materialized()
    if state.group is not None and num_forwards == 0:
        install(state.group, unshard(state.group))
    state._traced_num_forwards = num_forwards + 1
    return _cast_inputs(state, (args, kwargs))


def _cast_inputs(state: FSDPState, inputs: Any) -> Any:
    """A call's inputs (any structure of them), cast as the mixed precision policy says."""
    if state.mp_policy.param_dtype is not None and state.mp_policy.cast_forward_inputs:
        inputs = cast_floats(inputs, state.mp_policy.param_dtype)
    return inputs


def _cast_output(state: FSDPState, output: Any) -> Any:
    if state.mp_policy.output_dtype is not None:
        output = cast_floats(output, state.mp_policy.output_dtype)
    return output


def region_pre_forward(state: FSDPState, inputs: list) -> tuple[list[torch.Tensor], list]:
    """Traced pre-forward of a block traced as a region: its gathered tensors (not installed) and
    its inputs (the call's arguments, flat), cast. See [Note: Blocks as compile regions]."""
    return unshard(state.group), _cast_inputs(state, inputs)


def region_post_forward(state: FSDPState, output: Any) -> Any:
    """Traced post-forward of a block traced as a region: cast the outputs."""
    return _cast_output(state, output)


def post_forward(state: FSDPState, module: torch.nn.Module, output: Any) -> Any:
    """Traced post-forward: cast the outputs; after the group's last module, drop the shadows."""
    output = _cast_output(state, output)
    if state._traced_num_forwards >= len(state.modules):
        state._traced_num_forwards = 0
        if state.group is not None:
            install(state.group, None)
        if state.is_root:
            close_partly_run_groups(state)
    return output


def close_partly_run_groups(root: FSDPState) -> None:
    """At the root's post-forward: drop the shadows of every `fully_shard([a, b])` group whose
    forward ran only some of its modules (a chunked loss runs the head after the model's call).
    The root's eager post-forward calls it too, for a body traced without the root's hooks.

    [Note: Groups whose forward ran partly in a graph]
    Such a group was gathered in the graph, but its last post-forward never came, so its shadows
    would outlive the graph as the graph's outputs: a later eager call of the remaining module
    would read them and backpropagate into the compiled backward (twice, for a second chunk). As
    in eager mode, that call gathers the group again on the eager hooks, and the gradients of both
    add up in the sharded `.grad`.
    """
    for state in root.ctx.states:
        if state is not root and state._traced_num_forwards > 0:
            state._traced_num_forwards = 0
            if state.group is not None:
                install(state.group, None)


# [Note: Sharded modules inside activation checkpointing]
# `checkpoint(block, h)` around a sharded module runs the module's hooks inside Dynamo's checkpoint
# region, and the traced hooks write state that lives outside it (the parameter shadows, the
# forward counter). By default Dynamo refuses such writes in a checkpoint region, since eager
# checkpointing would run them again in the recompute, and breaks the graph there: the whole root
# would fall back. Our writes undo themselves within the module's call and only steer tracing;
# the recompute needs the graph's ops, not them. So the first `fully_shard` turns on Dynamo's
# `skip_fwd_side_effects_in_bwd_under_checkpoint`: side effects in a checkpointed function run once,
# in forward. (A user's own side effect in a checkpointed function is then also not run again in
# backward; see docs/compiler.md, Compiled training.) The recomputed region gathers its group once, like the
# reshard_after_forward re-gather: tests/test_compile_features.py counts them.


def trace_hooks_inside_checkpoint() -> None:
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


# -- fallback --------------------------------------------------------------------------------------

# [Note: Fallback to the eager hooks]
# Dynamo traces a module call as a whole or not at all: a graph break anywhere inside the call
# (without nested graph breaks, which torch 2.13 leaves off) makes the enclosing traced frame stop
# at the call and run it in Python, and a `torch.compiler.disable`d module or forward is always run
# that way. Dynamo then treats every Python function the call reaches as a frame of its own, the
# forward hooks included, and would compile each hook into a tiny graph whose gathered tensors leave
# the graph. Instead the two forward hooks' code objects are marked "skip this frame and everything
# it calls" (`FrameAction.SKIP` twice). That mark only concerns frames Dynamo is handed by CPython;
# inlining ignores it, so a traced module call still traces the hooks. A module whose call Dynamo
# ran in Python therefore goes through the eager runtime's hooks: bucketed, with the same numbers,
# its gradients reduced by the eager post-backward. A module is on one path or the other for a whole
# call, so no group is gathered by both or left unreduced:
#   traced group: stays SHARDED in eager terms; autograd writes the DTensor gradients;
#   eager group:  the usual unshard/reshard/reduce-scatter; the root's final callback finishes it.
# The root falls back whenever any break propagates up to it, since its call encloses all others.


# [Note: Fallback groups keep the traced order]
# Whether a module call is traced or falls back is decided by Dynamo on each rank: one rank can reach
# `recompile_limit` for an expert's frame, or break a graph on its data, while the other runs the
# traced graph of the same group. The two paths then must issue the same collectives in the same
# order. The bytes are the same ([Note: One bucket layout for eager and traced steps] in
# runtime/bucket_layout.py); and a group whose forward fell back does what its graph would do, in the
# same place: it prefetches nothing (the graph's gather of the next group is in that group's own
# graph), and an int `reshard_after_forward` reshards fully, so backward re-gathers from the whole
# shard group as the graph does. Its reduce-scatter runs when its gradients are ready, or when its
# backward reaches its inputs where some never come on this rank (an expert without tokens):
# where the graph's backward runs it ([Note: A fallback group's backward ends at its inputs] in
# runtime/param_group.py). What this does not cover: a graph whose passes merged or reordered
# collectives of several groups, when another rank runs one of those groups on the eager hooks
# (README, Differences from FSDP2; docs/compiler.md), except where the whole call falls back:
# [Note: A fallback keeps the frame's wire order] in runtime/wire_plan.py.


# [Note: Groups that stay on the eager hooks]
# Some controls change what a group's backward does in ways a graph does not express: a comm hook
# (arbitrary Python replacing the reduce-scatter), gradient sync turned off (unsharded gradients
# accumulate across backwards), and the first synced backward after that (it reduces what
# accumulated). While `ParamGroup.eager_only_reason()` says so for any group under a root,
# `FSDPModule.__call__` hands the root's whole call to `call_on_eager_hooks` (traced/call.py), disabled for its own
# frame only: a graph break in the compiled frame itself, which Dynamo resumes after, so the call
# runs on the eager hooks and nothing is marked to be skipped for good. A break inside the hooks
# would not do: Dynamo cannot resume inside inlined code and would give up on the frame. The frames
# the call reaches are still Dynamo's: the forwards between the hooks compile, each sharded module
# call in them whose group has such a reason breaking out the same way (one without is traced into
# that frame's graph), which is what torch's fully_shard gives under
# torch.compile (its hooks are disabled); a call disabled with everything below it would compile
# nothing, and gradient accumulation would run uncompiled. The break is taken in
# `FSDPModule.__call__` itself, not in a helper it calls: a helper's frame, resumed after the
# break, would be compiled again for every kind of module and arguments until Dynamo's recompile
# limit. Dynamo guards on the flags it read, so once they clear the next step runs the full graph
# again. `record_fallback` says it once per reason at WARNING, with what to do where there is
# something (gradient accumulation: sync in every micro-batch); tests/test_frameworks.py checks
# accumulation through Accelerate against torch's fully_shard.


def skip_when_not_inlined(*hooks) -> None:
    """Make Dynamo run `hooks` (and what they call) eagerly when it meets them as frames."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    for hook in hooks:
        set_code_exec_strategy(hook.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def skip_own_frame(*fns) -> None:
    """For functions wrapped in `torch._dynamo.disable(recursive=False)`: mark the function's own
    code as skipped once, so that Dynamo does not look at its frame again on every call (a
    bytecode scan each time), while the frames it calls are still Dynamo's to compile."""
    for fn in fns:
        torch._dynamo.eval_frame.skip_code(fn.__wrapped__.__code__)


def in_compiled_call() -> bool:
    """True inside a call of a `torch.compile`d module (whose frames Dynamo may or may not trace)."""
    return torch._dynamo.eval_frame._is_in_optimized_module()


_FALLBACK_REASON = (
    "Dynamo ran the module's call in Python instead of tracing it: a graph break inside or around "
    "the call, or torch.compiler.disable on the module or its forward (TORCH_LOGS=graph_breaks shows "
    "the break); its group used the eager runtime's hooks"
)


def record_fallback(state: FSDPState) -> None:
    """Note (once per state and root) that `state`'s hooks ran eagerly inside a compiled call."""
    fallbacks = state.ctx.fallbacks
    if state.name not in fallbacks:
        reason = state.eager_only_reason()
        if reason is not None:  # a setting of the user's, the same in every group that has it: said once
            reason = f"its group stays on the eager runtime's hooks: {reason}"
            said = reason in fallbacks.values()
        else:
            reason = state.hooks_around_compiled_body or _FALLBACK_REASON
            said = False
        fallbacks[state.name] = reason
        if said:
            logger.debug("fsdp_graph::fallback (%s): %s", state.name, reason)
        else:
            logger.warning("fsdp_graph::fallback (%s): %s", state.name, reason)
        if state.group is not None:  # where another rank may have traced it ([Note: Ranks that compile different graphs])
            peer_log.tell(state.group.mesh_info.ranks, f"eager:{state.name}")
