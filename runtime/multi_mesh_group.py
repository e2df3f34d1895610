"""The parameters of one `fully_shard` call sharded over several meshes, driven as one group.

[Note: A group on several meshes]
`shard_placement_fn` may give a parameter a mesh of its own (FSDP2's `ShardPlacementResult`): with
expert parallelism, the expert weights shard over the data-parallel ranks left after expert
parallelism, the dense weights over the whole data-parallel mesh. Each mesh has its own process
group, so its parameters are a `ParamGroup` of their own: their own all-gather, reduce-scatter,
bucket layout and gradient count, as FSDP2 makes one `FSDPParamGroup` per process group. The
state of the `fully_shard` call drives a `MultiMeshGroup`, which does to each of its groups, in
one order every rank shares, what the state asks of a group: every rank issues the same
collectives per process group in the same order. The call's settings (gradient sync, divide
factor, hooks, ...) apply to every group, as FSDP2's module setters do. A compiled step traces each
group's gather and reduce-scatter as those of a group of its own (traced/unshard.py), named by the
call's modules and its mesh's axes ("blocks.0 [efsdp]"), and the passes bucket and move them on
their own process group; a rank that replays a graph's order on the eager hooks gives each group its
own turn (`mesh_groups`).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from .mesh_info import MeshInfo
from .param import ShardedParam
from .param_group import ParamGroup, ShardedState

# Settings a state or the module's setters write on a group: written to every group of the
# call, read from the first.
_SHARED_SETTINGS = (
    "comm",
    "on_all_grads_ready",
    "backward_writes_param_grads",
    "requires_gradient_sync",
    "reshard_after_backward",
    "gradient_divide_factor",
    "comm_hook",
    "unshard_in_backward",
    "custom_all_gather",
    "custom_reduce_scatter",
    "allocate_from_process_group",
    "uses_process_group_allocator",
)


def _shared(name: str) -> property:
    def get(self):
        return getattr(self.groups[0], name)

    def set_(self, value):
        for group in self.groups:
            setattr(group, name, value)

    return property(get, set_, doc=f"`ParamGroup.{name}` of every group of the call.")


class _SharedControls:
    """The groups' `ReduceControls` as one: a write goes to every group's, a read comes from the
    first's. Each group keeps its own (its HSDP partial sums and reduce-scatter group are its own)."""

    def __init__(self, groups: tuple[ParamGroup, ...]) -> None:
        object.__setattr__(self, "_groups", groups)

    def __getattr__(self, name: str):
        return getattr(self._groups[0].reduce_controls, name)

    def __setattr__(self, name: str, value) -> None:
        for group in self._groups:
            setattr(group.reduce_controls, name, value)


class MultiMeshGroup:
    """One `ParamGroup` per mesh for the parameters of one `fully_shard` call, used as one group.
    See [Note: A group on several meshes]."""

    def __init__(self, groups: list[ParamGroup], mesh_info: MeshInfo) -> None:
        self.groups = tuple(groups)
        self.mesh_info = mesh_info  # fully_shard's mesh
        self.mp_policy = groups[0].mp_policy
        self.reduce_controls = _SharedControls(self.groups)
        self.params: list[ShardedParam] = [p for g in self.groups for p in g.params]
        self.has_tp = any(g.has_tp for g in self.groups)
        self.owner_slots = tuple((module, name, i) for i, p in enumerate(self.params) for module, name in p.owners)
        self._name = "<unnamed>"

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        """The module FQN(s); each group's logs and profiler ranges add its mesh's axis names."""
        self._name = value
        for group in self.groups:
            group.name = value + mesh_suffix(group.mesh_info)

    # -- state, read over the groups ------------------------------------------------------------

    @property
    def state(self) -> ShardedState:
        """SHARDED once every group is; else UNSHARDED if any group is."""
        states = {g.state for g in self.groups}
        if len(states) == 1:
            return states.pop()
        return ShardedState.UNSHARDED if ShardedState.UNSHARDED in states else ShardedState.SHARDED_POST_FORWARD

    @property
    def num_trainable(self) -> int:
        return sum(g.num_trainable for g in self.groups)

    @property
    def all_grads_ready(self) -> bool:
        return all(g.all_grads_ready for g in self.groups)

    @property
    def reduced_this_backward(self) -> bool:
        return all(g.reduced_this_backward for g in self.groups)

    @property
    def holds_unreduced_grads(self) -> bool:
        return any(g.holds_unreduced_grads for g in self.groups)

    @holds_unreduced_grads.setter
    def holds_unreduced_grads(self, value: bool) -> None:
        for group in self.groups:
            group.holds_unreduced_grads = value

    @property
    def reshard_after_forward(self) -> Optional[Union[bool, int]]:
        return self.groups[0].reshard_after_forward

    def parallelism_names(self) -> frozenset[str]:
        return frozenset().union(*(g.parallelism_names() for g in self.groups))

    def process_group_allocates(self) -> bool:
        return any(g.process_group_allocates() for g in self.groups)

    def eager_only_reason(self) -> Optional[str]:
        """The first group's reason to stay on the eager hooks, or None."""
        return next((r for r in (g.eager_only_reason() for g in self.groups) if r is not None), None)

    # -- what the state asks of a group, done to each group in turn ------------------------------

    def _each(self, method: str, *args) -> None:
        for group in self.groups:
            getattr(group, method)(*args)

    def unshard(self, async_op: bool = False) -> None:
        self._each("unshard", async_op)

    def wait_for_unshard(self) -> None:
        self._each("wait_for_unshard")

    def reshard(self) -> None:
        self._each("reshard")

    def post_forward_reshard(self, full: bool = False) -> None:
        self._each("post_forward_reshard", full)

    def follow_registered_params(self) -> None:
        self._each("follow_registered_params")

    def set_reshard_after_forward(self, value: Union[bool, int]) -> None:
        self._each("set_reshard_after_forward", value)

    def set_separate_reduce_scatter_group(self, enable: bool, made: dict) -> None:
        self._each("set_separate_reduce_scatter_group", enable, made)

    def pin_shards(self) -> None:
        self._each("pin_shards")

    def post_backward(self) -> None:
        """Reduce-scatter each group's gradients. A replayed graph order asks each group itself
        (`mesh_groups`): [Note: A fallback keeps the frame's wire order] in runtime/wire_plan.py."""
        self._each("post_backward")

    def expect_input_grads(self, reduces_at_inputs: bool = False) -> None:
        self._each("expect_input_grads", reduces_at_inputs)

    def input_grads_done(self) -> None:
        self._each("input_grads_done")

    def zero_grads_of_unused_group(self) -> None:
        self._each("zero_grads_of_unused_group")

    def reset_backward_state(self) -> None:
        self._each("reset_backward_state")


for _setting in _SHARED_SETTINGS:
    setattr(MultiMeshGroup, _setting, _shared(_setting))


def mesh_suffix(mesh_info: MeshInfo) -> str:
    """What a group of a call on several meshes adds to the call's name: its mesh's axes, " [efsdp]"."""
    return f" [{', '.join(mesh_info.mesh.mesh_dim_names or ('?',))}]"


def split_mesh_suffix(group_name: str) -> tuple[str, str]:
    """A group's name as (the call's name, `mesh_suffix` or "" for a group on one mesh)."""
    cut = group_name.find(" [")
    return (group_name, "") if cut < 0 else (group_name[:cut], group_name[cut:])


def mesh_groups(group: Union[ParamGroup, MultiMeshGroup]) -> tuple[ParamGroup, ...]:
    """The `ParamGroup`s a state's group is made of, one per mesh: each has its own collectives."""
    return group.groups if isinstance(group, MultiMeshGroup) else (group,)


def group_by_mesh(
    params: list[ShardedParam],
    mesh_info: MeshInfo,
    make_group: Callable[[list[ShardedParam], MeshInfo], ParamGroup],
) -> Union[ParamGroup, MultiMeshGroup, None]:
    """The group of a `fully_shard` call's parameters: None without parameters, a `ParamGroup`
    where they all shard over one mesh, else a `MultiMeshGroup` of one `ParamGroup` per mesh, in
    the order of each mesh's first parameter. Parameters whose meshes have the same process groups
    share one; `mesh_info` is fully_shard's mesh."""
    by_mesh: dict[tuple, tuple[MeshInfo, list[ShardedParam]]] = {}
    for p in params:
        key = (p.mesh_info.shard_group_name, p.mesh_info.replicate_group_name)
        by_mesh.setdefault(key, (p.mesh_info, []))[1].append(p)
    groups = [make_group(members, info) for info, members in by_mesh.values()]
    if len(groups) <= 1:
        return groups[0] if groups else None
    return MultiMeshGroup(groups, mesh_info)
