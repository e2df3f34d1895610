"""What Dynamo's compile callbacks do for every sharded model alive: follow the parameters before a
trace reads them, and lift the owner checks while Dynamo compiles ([Note: Owner checks while
compiling]). And what fsdp_graph keeps beyond a model, with its owner: [Note: Process-wide state].
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# [Note: Process-wide state]
# A process may build many models of the same classes (a sweep, a notebook run again, a train and
# an eval copy, a reward model beside a policy, a test suite), and resets Dynamo between them. What
# fsdp_graph keeps beyond a model, and who owns it (tests/test_two_models.py trains two models of
# the same classes one after the other and interleaved, through every compile mode):
# - `_roots` below: the live root contexts, weakly; a model gone leaves it.
# - Dynamo's compile callbacks (`ensure_compile_callbacks`): Dynamo's process-wide list, which
#   `torch._dynamo.reset()` clears; registered again wherever missing ([Note: Compile callbacks
#   outlive a Dynamo reset]). Registered once per process, they left every compile after a reset
#   tracing parameters as followed before it: a group unfrozen since got no gradient.
# - `_region_ids`/`_region_states` (traced/state.py; region ids for Dynamo's constant calls): a counter that never
#   hands out an id twice, and states held weakly, so a dead model's id names nothing.
# - The block kinds a trace traced inline (`_kinds_traced`, traced/kinds.py): owned by the
#   trace under way (its TracingContext, weakly), not by its compile id, which starts again at 0
#   after a reset.
# - Frames' wire orders (fsdp_graph/compile/agreement.py): per root context, weakly. The peer log
#   (runtime/peer_log.py: each rank's next index per set of ranks, and the sets marked diverged)
#   belongs to the default process group it is kept in (weakly, per group object): a new process
#   group starts a fresh log ([Note: One log per process group]). Within one process group it is
#   one sequence every model's graphs count in: a divergence seen with one model keeps later graphs
#   of several groups in program order (the same numbers, unmerged).
# - The default mesh per device type (fsdp_graph/api/mesh.py): tied to the default process group
#   it was made for; a new group gets a new mesh.
# - One `FSDP<Cls>` class per user class, with a `__call__` code object of its own
#   (fsdp_graph/api/module.py `_fsdp_class`): Dynamo's per-code state (shapes seen, recompile
#   count) is then shared by models of one class, as torch's `fully_shard` shares it; it holds no
#   state of a model.
# - Global hooks installed once (the optimizer step check, parameter registrations): they hold no
#   state and reach the model through the parameter they are given.
# - The stand-in for torch's `fully_shard` (fsdp_graph/api/stand_in.py): process-wide by what it
#   replaces, until `.restore()`; the backend's capture settings (traced/scope.py): a stack
#   a context manager pushes and pops.
# - Files beside the compile caches: keyed by the graph, our sources' digest and the options.

# Every root context alive (traced/state.py, TracedRootContext), for `_follow_all_roots`; contexts of outer roots replace inner ones.
_roots: "weakref.WeakSet[Any]" = weakref.WeakSet()


def follow_before_compiling(ctx: Any) -> None:
    _roots.add(ctx)
    ensure_compile_callbacks()


def ensure_compile_callbacks() -> bool:
    """Register the compile callbacks below with Dynamo where they are not registered now; True if
    they had to be. See [Note: Compile callbacks outlive a Dynamo reset]."""
    handler = torch._dynamo.callback.callback_handler
    if _follow_all_roots in handler.start_callbacks:
        return False
    torch._dynamo.callback.on_compile_start(_follow_all_roots)
    torch._dynamo.callback.on_compile_start(_lift_checks_for_compile)
    torch._dynamo.callback.on_compile_end(_restore_checks_after_compile)
    return True


@torch._dynamo.assume_constant_result
def followed_for_this_trace() -> bool:
    """Called by the traced root before it reads anything followed: where a `torch._dynamo.reset()`
    since the callbacks were registered cleared them, so that this compile started without them, do
    now what they do at a compile's start. Plain Python while Dynamo traces; the answer is a
    constant and leaves no guard."""
    if ensure_compile_callbacks():
        _follow_all_roots()
        _lift_checks_for_compile()
    return True


# [Note: Compile callbacks outlive a Dynamo reset]
# A trace reads what the compile-start callback followed ([Note: Tracing reads what was followed]),
# so the callback must run before every trace of a root. `torch._dynamo.reset()` clears every
# callback registered with Dynamo, as if the process started anew; a test suite, a sweep or a
# notebook resets between models. Had the callbacks been registered once per process, every
# compile after a reset would trace parameters as they were followed last: a group frozen then and
# unfrozen since traced as frozen, and its gradients silently never computed (issue #77). So they
# are registered again wherever they are missing: when a root is made, at every eager root call,
# and, for a model that is only ever called compiled, by the traced root itself, which then follows
# every root before reading anything followed (`followed_for_this_trace`); the end callback
# registered then runs at the end of that same compile.


# [Note: Owner checks while compiling]
# Each submodule holding a group's parameters has a forward pre-hook, the call check
# (`_check_called_through_group`), which never fires inside a group's call. A module with hooks
# makes torch's `_call_impl` take its slow path, which Dynamo traces instruction by instruction:
# about one instruction in eight of a traced HF Llama layer went to running checks that return at
# once. So the checks are lifted while Dynamo compiles and put back when it is done (Dynamo's
# callbacks run once for the outermost compile, the end one even when it fails); a compiled step
# never runs them, as before. Only a check that is its module's one hook is lifted: Dynamo guards
# no empty hook dict (`skip_nnmodule_hook_guards`), so putting it back recompiles nothing, but it
# guards the length of one that is not empty, and a module with other hooks (TP's input and
# output hooks) takes the slow path anyway: there, lifting the check recompiled every step.


def _live_contexts() -> list[Any]:
    """The root contexts alive, each once (a context an outer root claimed since is not)."""
    return [ctx for ctx in list(_roots) if ctx.root.ctx is ctx]


def _lift_checks_for_compile(*_args) -> None:
    for ctx in _live_contexts():
        for state in ctx.states:
            ctx.checks_lifted_for_compile += state.lift_owner_checks(sole_hooks_only=True)


def _restore_checks_after_compile(*_args) -> None:
    for ctx in _live_contexts():
        lifted, ctx.checks_lifted_for_compile = ctx.checks_lifted_for_compile, []
        for check in lifted:
            check.restore()


# [Note: Tracing reads what was followed]
# Dynamo traces every Python instruction of our hooks, and at a whole step's depth each one per
# parameter counts (issue #46: our hooks were half of a traced layer). What does not change within
# a trace is therefore settled before it, by the compile-start callback, in eager Python: every
# parameter followed and every group's layout refreshed (`follow_registered_params`), and what the
# root's meta and replacement check finds (`problem_before_trace`). The trace then reads the result
# as it is: the followed shards (`ShardedParam.sharded_param`), `group.layout`, and the check's
# outcome, which Dynamo guards like any attribute it reads (it changes only when a compile start
# computes it anew). What changes a trace's inputs between steps still recompiles: requires_grad
# and dtype through Dynamo's guards on the shards, a parameter assigned anew through
# `parameters_replaced`; all-gather extensions set on a shard after its first trace are taken at
# the next recompile (FSDP2 takes them at its lazy init only).


def _follow_all_roots(*_args) -> None:
    """Before Dynamo traces a frame: every root takes the sharded parameters its modules hold now,
    so the graph reads them and their gradients are watched ([Note: The sharded parameter is the
    one its module holds] in runtime/param.py), and its groups' bucket layouts follow them. A
    replacement that cannot be a shard is left for the traced root's check, which names every such
    parameter, and all-gather extensions that break FSDP2's contract for the trace's own gather."""
    for ctx in _live_contexts():
        try:
            ctx.root.follow_registered_params()
        except (ValueError, TypeError):
            pass
        ctx.problem_before_trace = ctx.root.materialization_problem()


