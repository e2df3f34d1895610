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
that the wire carries what the graph's wire carries.

A plan is made only of single groups' all-gathers and reduce-scatters; a frame whose graph merged
groups into one collective, or holds another collective (tensor parallel, HSDP's all-reduce), gets
no plan, and its fallback issues the hooks' own order. A backward that needs a group's parameters
before a reduce-scatter the plan puts first (an autograd order other than the graph's) cannot keep
the plan: that is logged as a warning and the hooks go on in their own order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from .param_group import ParamGroup, ShardedState

logger = logging.getLogger(__name__)

GATHER = "all_gather"
REDUCE = "reduce_scatter"


@dataclass(frozen=True)
class WirePlan:
    """The collectives of a compiled frame's forward and backward graphs, in wire order, as
    (GATHER or REDUCE, group name) pairs."""

    forward: tuple[tuple[str, str], ...]
    backward: tuple[tuple[str, str], ...]

    @property
    def regathered(self) -> frozenset[str]:
        """The groups the backward gathers again: those the forward resharded."""
        return frozenset(name for kind, name in self.backward if kind == GATHER)


class Replay:
    """One step of a `WirePlan` on the eager hooks: [Note: A fallback keeps the frame's wire order]."""

    def __init__(self, plan: WirePlan, groups: dict[str, ParamGroup]) -> None:
        self.plan = plan
        self.groups = groups
        self.items = plan.forward
        self.cursor = 0  # items before it are issued
        self.pending: set[str] = set()  # groups done with their backward, whose reduce-scatter waits its turn
        self.kept_order = True

    def gather(self, group: ParamGroup) -> None:
        """Issue `group`'s all-gather where the plan has it (what comes before it first), or as the
        hooks would where the plan has none left for it."""
        index = self._next(GATHER, group.name)
        if index is not None and not self._issue_through(index):
            self._lose_order(f"{group.name}'s all-gather waits for a reduce-scatter whose gradients are not here")
        group.unshard()

    def reduce(self, group: ParamGroup) -> None:
        """`group`'s gradients are all here: reduce-scatter them in their turn."""
        index = self._next(REDUCE, group.name)
        if index is None:
            group.post_backward()
            return
        self.pending.add(group.name)
        self._issue_through(index)

    def after_forward(self, group: ParamGroup) -> None:
        """Reshard `group` at its forward's end if the plan gathers it again in backward; else keep it."""
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

    def _next(self, kind: str, name: str) -> Optional[int]:
        for index in range(self.cursor, len(self.items)):
            if self.items[index] == (kind, name):
                return index
        return None

    def _issue_through(self, end: int, finishing: bool = False) -> bool:
        """Issue items up to `end`, then the reduce-scatters already due after it; False where a
        reduce-scatter not yet due stopped it first (`finishing`: every one is due)."""
        while self.cursor < len(self.items):
            kind, name = self.items[self.cursor]
            if self.cursor > end and not (kind == REDUCE and name in self.pending):
                break
            group = self.groups.get(name)
            if kind == REDUCE:
                if name not in self.pending and not finishing:
                    return False
                self.pending.discard(name)
                if group is not None:
                    group.post_backward()
            elif group is not None:
                if group.state is ShardedState.UNSHARDED:
                    group.reshard()  # gathered already, but the graph gathers it here: so does this rank
                group.unshard(async_op=True)
                if finishing:  # a gather nobody here uses
                    group.wait_for_unshard()
                    if self.items is self.plan.forward:
                        self.after_forward(group)
            self.cursor += 1
        return True

    def _lose_order(self, why: str) -> None:
        if self.kept_order:
            self.kept_order = False
            logger.warning("fsdp_graph: this rank runs a compiled step on the eager hooks and cannot keep the "
                           "compiled graph's order of collectives (%s); the other ranks may wait for ever "
                           "([Note: A fallback keeps the frame's wire order] in runtime/wire_plan.py)", why)
