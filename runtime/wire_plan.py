"""A rank that runs a compiled step on the eager hooks keeps the order the compiled graphs put its
collectives on the wire in.

[Note: A fallback keeps the frame's wire order]
Dynamo decides per rank, and per call, whether a frame runs its compiled graph: a rank whose inputs
fail the guards after `recompile_limit` graphs runs the whole call in Python (Dynamo's RUN_ONLY,
which reaches every frame the call makes), so its groups gather and reduce on the eager hooks,
while the other ranks run the graph they compiled before. The graph's scheduling passes moved
collectives of different groups past each other (a block's re-gather before the next block's
reduce-scatter, to overlap it with that block's backward), and the eager hooks, which issue each
group's collectives where its module runs, would put them on the wire in another order: gloo
aborts, NCCL hangs or mixes the groups' bytes.

The compiled frame's first graphs record their wire orders (fsdp_graph/compile/agreement.py, [Note:
One wire order per frame]), and every later graph of the frame issues that order. The backend hands
the root context the order as a `WirePlan` of (collective, group) pairs. A root whose call falls
back runs the step as a `Replay` of it: a group's all-gather or reduce-scatter is issued where the
plan has it, after everything the plan has before it (all-gathers are issued early, as prefetches;
a reduce-scatter whose group is not done waits for it, and the collectives after it wait too); the
groups the plan re-gathers in backward reshard after forward and the others stay gathered, as in
the graph. What is left at the end of a forward or backward is issued then, unused gathers too, so
that the wire carries what the graph's wire carries. A root that runs on the hooks because of a
setting of the user's (no sync, a comm hook: `eager_only_reason`) replays nothing: every rank has
the setting, so no rank runs the graph, and the hooks do what the setting asks.

A plan is made of FSDP groups' all-gathers and reduce-scatters: each group's alone, several groups'
merged into one collective, or one group's bucket cut in pieces, as `auto_bucket` left them (the
hooks issue those as [Note: A compiled graph's buckets on the eager hooks] in runtime/collectives.py
says), and HSDP's all-reduces of each group's reduced shard over the replicas. The graph issues an
all-reduce later than the hooks do (after the next block's re-gather; the root's before the first
block's), so a replayed reduce-scatter leaves its all-reduce and division for the plan to issue
(`ReduceScatterWork.all_reduce_later`); on the replicate group as on the shard group, every rank
then issues the graph's order, and no rank waits on one collective while the others wait on one it
has yet to issue. Tensor parallel's collectives are the model's code's to issue, where it runs: the
plan names them (`OTHER`, by mesh dim) and skips them, which keeps FSDP's order on FSDP's process
groups; that holds while the ranks of a tp group fall back together (they see the same inputs, so
they compile alike). A graph with collectives of its own on a group's process group gets no replay,
nor does a frame whose graph holds a group's bucket twice: the fallback issues the hooks' own
order. A backward that needs a group's parameters before a reduce-scatter the plan puts first (an
autograd order other than the graph's) cannot keep the plan: that is logged as a warning and the
hooks go on in their own order.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional, Union

from .collectives import AllGatherWork, ReduceScatterWork, all_gather_pieces, reduce_scatter_issued, reduce_scatter_pieces
from .multi_mesh_group import MultiMeshGroup, mesh_groups
from .param_group import ParamGroup, ShardedState

logger = logging.getLogger(__name__)

GATHER = "all_gather"
REDUCE = "reduce_scatter"
ALL_REDUCE = "all_reduce"  # HSDP's, of one group's reduce-scattered shard over the replicas
OTHER = "other"  # another parallelism's (tensor parallel's): the model's code issues it

# One collective of a plan: GATHER, REDUCE or ALL_REDUCE, the groups whose buckets it carries side by
# side, and (k, n) where it is piece k of n of one group's bucket (passes/wire_order.py's
# `eager_collectives`); or OTHER and the parallelism it belongs to (`parallelism_name`).
Collective = tuple[str, tuple[str, ...], Optional[tuple[int, int]]]


@dataclass(frozen=True)
class WirePlan:
    """The collectives of a compiled frame's forward and backward graphs, in wire order."""

    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]

    @property
    def regathered(self) -> frozenset[str]:
        """The groups the backward gathers again: those the forward resharded."""
        return frozenset(name for kind, names, _ in self.backward if kind == GATHER for name in names)

    @property
    def others(self) -> frozenset[str]:
        """The parallelisms whose collectives the graphs hold beside the groups' (`OTHER`)."""
        return frozenset(names[0] for kind, names, _ in self.forward + self.backward if kind == OTHER)


def _columns(width: int, piece: Optional[tuple[int, int]]) -> tuple[int, int]:
    """The columns of a bucket `width` wide that piece (k, n) carries: as passes/bucketing.py cuts."""
    if piece is None:
        return 0, width
    k, n = piece
    step = math.ceil(width / n)
    return min(k * step, width), min((k + 1) * step, width)


def _sharded(group: ParamGroup) -> ParamGroup:
    """`group`, resharded if it is gathered already: the graph gathers it where the plan does, so
    this rank does too."""
    if group.state is not ShardedState.SHARDED:
        group.reshard()
    return group


class Replay:
    """One step of a `WirePlan` on the eager hooks: [Note: A fallback keeps the frame's wire order]."""

    def __init__(self, plan: WirePlan, groups: dict[str, ParamGroup]) -> None:
        self.plan = plan
        self.groups = groups
        self.items = plan.forward
        self.cursor = 0  # items before it are issued
        self.pending: set[str] = set()  # groups done with their backward, whose reduce-scatter waits its turn
        # Groups reduce-scattered whose replica all-reduce (HSDP) waits its turn.
        self.reduced: dict[str, ReduceScatterWork] = {}
        # Buckets issued in pieces or with other groups' buckets, by group, with the pieces issued so far.
        self.gathering: dict[str, tuple[AllGatherWork, int]] = {}
        self.reducing: dict[str, tuple[ReduceScatterWork, int]] = {}
        self.kept_order = True

    # A state's group on several meshes is one group per mesh to the plan, each with its own
    # collectives (`mesh_groups`, [Note: A group on several meshes]): each takes its own turn.

    def gather(self, state_group: Union[ParamGroup, MultiMeshGroup]) -> None:
        """Issue the group's all-gather where the plan has it (what comes before it first), or as
        the hooks would where the plan has none left for it."""
        for group in mesh_groups(state_group):
            index = self._last(GATHER, group.name)
            if index is not None and not self._issue_through(index):
                self._lose_order(f"{group.name}'s all-gather waits for a reduce-scatter whose gradients are not here")
            group.unshard()

    def reduce(self, state_group: Union[ParamGroup, MultiMeshGroup]) -> None:
        """The group's gradients are all here: reduce-scatter them in their turn (or all-reduce them,
        on one rank per shard group, where the graph has only HSDP's all-reduce)."""
        for group in mesh_groups(state_group):
            index = self._last(REDUCE, group.name)
            if index is None:
                index = self._last(ALL_REDUCE, group.name)
            if index is None:
                group.post_backward()
                continue
            self.pending.add(group.name)
            self._issue_through(index)

    def after_forward(self, state_group: Union[ParamGroup, MultiMeshGroup]) -> None:
        """Reshard the group at its forward's end if the plan gathers it again in backward; else keep it."""
        for group in mesh_groups(state_group):
            if group.name in self.plan.regathered:
                group.reshard()

    def end_forward(self) -> None:
        """Issue what the forward plan has left, and go on to the backward plan."""
        self._issue_through(len(self.items) - 1, finishing=True)
        self.items, self.cursor = self.plan.backward, 0

    def end_backward(self) -> None:
        """Issue what the backward plan has left: reduce-scatters of groups whose gradients never all
        came (every rank reduces every group) and gathers nobody here used."""
        self._issue_through(len(self.items) - 1, finishing=True)

    def _last(self, kind: str, name: str) -> Optional[int]:
        """The plan's last collective of `kind` left that carries `name`'s bucket (or a piece of it)."""
        found = None
        for index in range(self.cursor, len(self.items)):
            item_kind, names, _ = self.items[index]
            if item_kind == kind and name in names:
                found = index
        return found

    def _issue_through(self, end: int, finishing: bool = False) -> bool:
        """Issue items up to `end`, then the reduce-scatters already due after it; False where a
        reduce-scatter not yet due stopped it first (`finishing`: every one is due)."""
        while self.cursor < len(self.items):
            kind, names, piece = self.items[self.cursor]
            if kind == OTHER:  # the model's code issues it where it runs
                self.cursor += 1
                continue
            if kind == REDUCE:
                due = all(name in self.pending for name in names)
            else:
                due = kind == ALL_REDUCE and all(name in self.reduced or name in self.pending for name in names)
            if self.cursor > end and not due:
                break
            if kind != GATHER and not due and not finishing:
                return False
            if kind == REDUCE:
                self._reduce(names, piece)
            elif kind == ALL_REDUCE:
                self._all_reduce(names)
            else:
                self._gather(names, piece, finishing)
            self.cursor += 1
        return True

    def _all_reduces_later(self, name: str) -> bool:
        return self._last(ALL_REDUCE, name) is not None

    def _gather(self, names: tuple[str, ...], piece: Optional[tuple[int, int]], finishing: bool) -> None:
        groups = [self.groups.get(name) for name in names]
        if None in groups:
            self._lose_order(f"the plan gathers {names}, groups this root does not hold")
            return
        if len(groups) == 1 and piece is None:
            _sharded(groups[0]).unshard(async_op=True)
        else:
            pieces = []
            for group in groups:
                work, issued = self.gathering.get(group.name, (None, 0))
                if work is None:
                    work = _sharded(group).prepare_all_gather()
                self.gathering[group.name] = (work, issued + 1)
                pieces.append((work, *_columns(work.input.numel(), piece)))
            all_gather_pieces(pieces, groups[0].mesh_info.shard_group, groups[0].world, groups[0].comm)
            issued = [group for group in groups if self.gathering[group.name][1] == (piece[1] if piece else 1)]
            for group in issued:
                del self.gathering[group.name]
            groups = issued  # the others have pieces still to come
        if finishing:  # gathers nobody here uses
            for group in groups:
                group.wait_for_unshard()
                if self.items is self.plan.forward:
                    self.after_forward(group)

    def _reduce(self, names: tuple[str, ...], piece: Optional[tuple[int, int]]) -> None:
        groups = [self.groups.get(name) for name in names]
        if None in groups:
            self._lose_order(f"the plan reduces {names}, groups this root does not hold")
            return
        if len(groups) == 1 and piece is None:
            self.pending.discard(names[0])
            self._reduced(groups[0], groups[0].post_backward(all_reduce_later=self._all_reduces_later(names[0])))
            return
        pieces = []
        for group in groups:
            work, issued = self.reducing.get(group.name, (None, 0))
            if issued == 0:
                work = group.post_backward(issue=False, all_reduce_later=self._all_reduces_later(group.name))
                if work is None:
                    self._lose_order(f"{group.name} has no gradients to reduce where the graph reduces them")
                    return
            self.reducing[group.name] = (work, issued + 1)
            pieces.append((work, *_columns(work.keep_alive[0].numel() // group.world, piece)))
        reduce_group = groups[0].reduce_controls.reduce_scatter_group or groups[0].mesh_info.shard_group
        reduce_scatter_pieces(pieces, reduce_group, groups[0].world, groups[0].comm)
        for group, (work, _, _) in zip(groups, pieces):
            if self.reducing[group.name][1] == (piece[1] if piece else 1):
                del self.reducing[group.name]
                self.pending.discard(group.name)
                reduce_scatter_issued(work, group.comm)
                group.comm.add_reduce_scatter(work)
                self._reduced(group, work)

    def _reduced(self, group: ParamGroup, work: Optional[ReduceScatterWork]) -> None:
        if work is not None and work.all_reduce_later:
            self.reduced[group.name] = work

    def _all_reduce(self, names: tuple[str, ...]) -> None:
        (name,) = names
        group = self.groups.get(name)
        work = self.reduced.pop(name, None)
        if work is None and group is not None:  # no reduce-scatter before it: one rank per shard group
            self.pending.discard(name)
            work = group.post_backward(all_reduce_later=True)
        if work is None or not work.all_reduce_later:
            self._lose_order(f"{name} has no reduced gradients where the graph all-reduces them")
            return
        work.issue_replica_all_reduce(group.comm)

    def _lose_order(self, why: str) -> None:
        if self.kept_order:
            self.kept_order = False
            logger.warning("fsdp_graph: this rank runs a compiled step on the eager hooks and cannot keep the "
                           "compiled graph's order of collectives (%s); the other ranks may wait for ever "
                           "([Note: A fallback keeps the frame's wire order] in runtime/wire_plan.py)", why)
