"""The sharded model a Dynamo graph belongs to, read from the graph's inputs: which of them are
sharded parameters, the root contexts and ranks those belong to, and (while dumping) the groups
that fell back to the eager hooks in those roots."""

from __future__ import annotations

from typing import Any, Callable

from ..inspect.dump import GraphDump
from ..runtime.param import OWNER_ATTR
from ..runtime.param_group import ParamGroup


def sharded_param_of(t: Any):
    """The `ShardedParam` a graph input belongs to: a sharded parameter, or an unsharded one that
    the eager runtime reduces (a group that fell back); None for anything else."""
    owner = getattr(t, OWNER_ATTR, None)
    if owner is not None:
        return owner
    for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
        group = getattr(hook, "__self__", None)
        if isinstance(group, ParamGroup):
            return group.params[0]
    return None


def owners_of(example_inputs: list) -> list:
    """The `ShardedParam`s of a graph's inputs (`sharded_param_of`), in input order."""
    return [o for o in map(sharded_param_of, example_inputs) if o is not None]


def root_of(owner) -> Any:
    """The root context of a sharded parameter (`sharded_param_of`'s answer)."""
    return owner.group_modules[0]._fsdp_state.ctx


def ranks_of(owners: list) -> list[int]:
    """The ranks of the meshes the graph's sharded parameters live on."""
    return sorted({r for o in owners for r in o.mesh_info.ranks})


class RecordFallbacks:
    """Wraps a compiled graph while dumping: after each call, writes new fallbacks of its roots."""

    def __init__(self, compiled: Callable, owners: list, dump: GraphDump) -> None:
        self.compiled = compiled
        self.dump = dump
        self.roots = []
        for owner in owners:
            ctx = root_of(owner)
            if all(ctx is not r for r in self.roots):
                self.roots.append(ctx)
        self._num_written = -1
        # Dynamo calls a compiled graph with boxed inputs when the callable says so.
        self._boxed_call = getattr(compiled, "_boxed_call", False)
        # `aot_compile` (fsdp_graph.precompile) saves a graph through its `serialize`: it saves the
        # graph this wraps, which a later launch loads without the dump.
        self.serialize = getattr(compiled, "serialize", None)

    def __call__(self, *args):
        out = self.compiled(*args)
        fallbacks = {name: reason for ctx in self.roots for name, reason in ctx.fallbacks.items()}
        if len(fallbacks) != self._num_written:
            self.dump.record_fallbacks(fallbacks)
            self._num_written = len(fallbacks)
        return out

