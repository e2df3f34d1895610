"""Reorder collectives for overlap with compute, within a bytes-in-flight limit and a memory budget
(passes/pin_order.py then pins the order so Inductor's scheduler keeps it).

Indices below count all-gathers (AG) in graph order and reduce-scatters (RS) by group; compute(i)
is what runs between wait(AG(i)) and wait(AG(i+1)). In the forward i runs over the root then the
blocks, in the backward over the blocks in reverse (so "AG(i+1)" there is the backward's next
re-gather, AG of the block before in forward order):

    AG(i+d) is issued before wait(AG(i)), so it runs under compute(i) (d = 1, or 2 when compute(i)
            alone cannot hide it); the first AG of a graph may go to the start of the graph;
    RS(i)   is issued right after the node that finishes its gradient;
    RS(i+1) with the nodes computing its input moves before the nodes computing only RS(i)'s input,
            when that hides more (the root's bucket at the end of a backward runs under the first
            block's weight-gradient bucketing), and keeps moving up while it does;
    wait(RS(i)) and the nodes that only feed the graph's outputs from it move to just before the
            issue of RS(i+1) or RS(i+2), or to the graph's end: the place that hides the most;
    wait(AG(i)) stays just before its first user.

Only FSDP's own collectives (`is_fsdp_collective`) move. Any other, e.g. tensor parallelism's
all-reduces, stays where it is with its wait, so their order on their process group is the traced
one, and FSDP's moves treat them as compute-like barriers that data preparation cannot cross;
FSDP's all-gathers and reduce-scatters still overlap the compute around them.

Each move is one candidate, tried in graph order; it is kept only if afterwards
    - the bytes of collectives issued and not yet waited on never exceed `max_bytes_in_flight`,
    - the simulated peak memory stays within `memory_budget_bytes` (or does not grow, when the
      graph exceeded it to begin with); without a budget, within the unscheduled peak plus two of
      the largest buckets (see [Note: Default memory headroom]), and
    - the simulated exposed communication does not grow (among prefetch depths, the smallest with
      the least exposure wins).
With `max_collectives_in_flight` (no limit by default), a move is also kept only if at most that many
collectives are in flight at any point.
So a tighter budget gives shallower prefetch (down to none), never an error. Decisions depend only
on shapes and the cost model, hence are the same on every rank. Rejections are logged with the
reason and recorded in `gm.meta[SCHEDULE_META]`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from torch.fx import GraphModule, Node

from .cost_model import CostModel
from .nodes import (
    PASS_META, is_all_gather, is_collective, is_fsdp_collective, is_reduce_scatter,
    is_wait_tensor, tensor_bytes, wait_of,
)
from .measured_order import MeasuredOrder
from .simulator import OpKind, OrderCost, _kind, op_of

logger = logging.getLogger(__name__)

SCHEDULE_META = "fsdp_graph_schedule"  # gm.meta: the `ScheduleReport` of the last reorder

# Prefetching 3 ahead gains nothing on one communication stream that 2 ahead does not already,
# unless single compute segments are far shorter than single all-gathers; it only costs memory.
_MAX_PREFETCH_DEPTH = 2


@dataclass
class ScheduleReport:
    """What `reorder_for_overlap` decided. Attributes: prefetch_depth (all-gather name -> depth
    kept), sunk_waits (collectives whose wait moved to the end), hoisted (reduce-scatters issued
    before an earlier one, once per step up), rejected ([collective, reason]),
    peak_bytes and exposed_s before/after (simulated), max_in_flight_bytes,
    max_in_flight_collectives and max_in_flight_all_gathers after; num_measured (candidate orders
    measured) and num_simulated (node positions simulated to measure them and the first order: what
    the pass's time grows with, see [Note: Measuring a move] in passes/measured_order.py)."""

    prefetch_depth: dict[str, int] = field(default_factory=dict)
    sunk_waits: list[str] = field(default_factory=list)
    hoisted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    peak_bytes_before: int = 0
    peak_bytes_after: int = 0
    exposed_s_before: float = 0.0
    exposed_s_after: float = 0.0
    max_in_flight_bytes: int = 0
    max_in_flight_collectives: int = 0
    max_in_flight_all_gathers: int = 0
    num_measured: int = 0
    num_simulated: int = 0


@dataclass(frozen=True)
class _Move:
    """A candidate order: the current body with positions lo..hi-1 replaced by `window`."""

    window: list[Node]
    lo: int
    hi: int


class _Order:
    """The current order of a graph's nodes (placeholders and output fixed at the ends), each
    node's position in it, and its measure, which also measures a move of it."""

    def __init__(self, gm: GraphModule, cost_model: CostModel) -> None:
        nodes = list(gm.graph.nodes)
        self.head = [n for n in nodes if n.op == "placeholder"]
        self.body = [n for n in nodes if n.op not in ("placeholder", "output")]
        self.tail = [n for n in nodes if n.op == "output"]
        self.index = {n: i for i, n in enumerate(self.body)}
        cost = OrderCost({n: op_of(n) for n in nodes}, cost_model)  # see [Note: Measuring candidate orders]
        self.measured = MeasuredOrder(cost, self.head + self.body + self.tail)  # see [Note: Measuring a move]

    def measure(self, move: _Move) -> tuple[int, float, tuple[int, int, int]]:
        """(simulated peak bytes, exposed seconds, (bytes, collectives, all-gathers) most in flight)
        of the order after `move`."""
        offset = len(self.head)
        return self.measured.measure(move.window, move.lo + offset, move.hi + offset)

    def accept(self, move: _Move) -> None:
        """Make the order after `move` the current one."""
        offset = len(self.head)
        self.measured.accept(move.window, move.lo + offset, move.hi + offset)
        self.body[move.lo : move.hi] = move.window
        for i in range(move.lo, move.hi):
            self.index[self.body[i]] = i

    def moved(self, nodes: list[Node], before: Optional[Node]) -> _Move:
        """The body with `nodes` (kept in their order) moved to just before `before` (None: the
        end), as the window of positions that changes: from the first place a node leaves or
        enters to the last."""
        at = self.index[before] if before is not None else len(self.body)
        positions = [self.index[n] for n in nodes]
        lo, hi = min(min(positions), at), max(max(positions) + 1, at)
        moving = set(nodes)
        assert before not in moving, before
        window = []
        for n in self.body[lo:hi]:
            if n is before:
                window.extend(nodes)
            if n not in moving:
                window.append(n)
        if at == hi:
            window.extend(nodes)
        return _Move(window, lo, hi)


def _inputs_after(node: Node, anchor_index: int, index: dict[Node, int]) -> Optional[list[Node]]:
    """`node` and what it depends on from `anchor_index` on, in order, if none is a collective's
    wait or anything else that must stay put (only data preparation moves); else None."""
    found: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found or n.op == "placeholder" or index[n] < anchor_index:
            continue
        if n is not node and (is_wait_tensor(n) or is_collective(n)):
            return None
        found.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(found, key=index.__getitem__)


def _last_barrier(node: Node, limit: int, index: dict[Node, int]) -> int:
    """The position of the last wait or collective that `node` depends on, looking back no further
    than `limit` (-1 if none)."""
    seen: set[Node] = set()
    stack = list(node.all_input_nodes)
    last = -1
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder" or index[n] < limit:
            continue
        seen.add(n)
        if is_wait_tensor(n) or is_collective(n):
            last = max(last, index[n])
            continue
        stack.extend(n.all_input_nodes)
    return last


def _own_inputs(node: Node, index: dict[Node, int]) -> list[Node]:
    """The compute nodes whose every use is `node` or another of them, in order: what is computed
    only for `node` (not placeholders, collectives or waits)."""
    own: set[Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in own or n.op != "call_function" or is_wait_tensor(n) or is_collective(n):
            continue
        if all(u is node or u in own for u in n.users):
            own.add(n)
            stack.extend(n.all_input_nodes)
    return sorted(own, key=index.__getitem__)


def _output_tail(wait: Node) -> Optional[list[Node]]:
    """`wait` and everything computed from it, if all of that only feeds the graph's output."""
    closure = {wait}
    stack = list(wait.users)
    while stack:
        n = stack.pop()
        if n.op == "output" or n in closure:
            continue
        closure.add(n)
        stack.extend(n.users)
    for n in closure:
        for user in n.users:
            if user.op != "output" and user not in closure:
                return None
        # A node with another input from after the wait is fine: moving to the end keeps it after.
    return list(closure)


def _last_outside_input(nodes: list[Node], index: dict[Node, int]) -> int:
    """The position in `index` of the latest input of `nodes` from outside them (-1 when there is
    none in `index`): `nodes` cannot move before it."""
    inside = set(nodes)
    return max([index.get(i, -1) for n in nodes for i in n.all_input_nodes if i not in inside], default=-1)


def _largest_bucket_bytes(nodes: list[Node]) -> int:
    """Bytes of the largest collective's full-size side (an all-gather's output, a reduce-scatter's
    input)."""
    sizes = [0]
    for n in nodes:
        if is_collective(n):
            sizes.append(max([tensor_bytes(n)] + [tensor_bytes(i) for i in n.all_input_nodes]))
    return max(sizes)




class _Scheduler:
    def __init__(
        self,
        gm: GraphModule,
        cost_model: CostModel,
        max_bytes_in_flight: Optional[int],
        memory_budget_bytes: Optional[int],
        max_collectives_in_flight: Optional[int],
    ) -> None:
        self.order = _Order(gm, cost_model)
        self.cost_model = cost_model
        self.max_bytes_in_flight = max_bytes_in_flight
        self.max_collectives_in_flight = max_collectives_in_flight
        self.memory_budget_bytes = memory_budget_bytes
        self.body = self.order.body  # the current order, changed in place as moves are accepted
        self.index = self.order.index  # node -> its position in `body`
        self.report = ScheduleReport()
        self._measure_current()
        self.report.peak_bytes_before, self.report.exposed_s_before = self.peak, self.exposed
        if memory_budget_bytes is None:
            # [Note: Default memory headroom] Without a budget, overlap may cost at most two of
            # the largest buckets over the unscheduled peak: enough for prefetch depth 2, and it
            # keeps sunk reduce-scatter waits from holding every full gradient to the graph's end.
            self.memory_budget_bytes = self.peak + 2 * _largest_bucket_bytes(self.body)

    def _measure(self, move: _Move) -> tuple[int, float, tuple[int, int, int]]:
        """(simulated peak bytes, exposed seconds, (bytes, collectives, all-gathers) most in flight)."""
        self.report.num_measured += 1
        return self.order.measure(move)

    def _accept(self, move: _Move) -> None:
        self.order.accept(move)
        self._measure_current()

    def _too_many_in_flight(self, flight: tuple[int, int, int]) -> Optional[str]:
        """Why `flight` (the last of what `_measure` gives) breaks a limit on how many are in flight, or None;
        a body no worse than the current one passes."""
        count = flight[1]
        limit = self.max_collectives_in_flight
        if limit is not None and count > limit and count > self.in_flight[1]:
            return f"{count} collectives in flight > max_collectives_in_flight={limit}"
        return None

    def _check(self, move: _Move) -> tuple[Optional[str], float]:
        """(why the order after `move` is rejected or None, its exposed seconds)."""
        peak, exposed, flight = self._measure(move)
        limit = self.max_bytes_in_flight
        if limit is not None and flight[0] > limit and flight[0] > self.in_flight[0]:
            return f"{flight[0]} bytes in flight > max_bytes_in_flight={limit}", exposed
        too_many = self._too_many_in_flight(flight)
        if too_many:
            return too_many, exposed
        budget = self.memory_budget_bytes
        if budget is not None and peak > budget and peak > self.peak:
            return f"peak {peak} bytes > memory_budget_bytes={budget}", exposed
        return None, exposed

    def _measure_current(self) -> None:
        measured = self.order.measured
        self.peak, self.exposed, self.in_flight = measured.peak, measured.exposed, measured.flight

    def _first_not_in(self, start: int, nodes: list[Node]) -> Optional[Node]:
        """The first node of the body from position `start` on that is not one of `nodes`."""
        return next((self.body[i] for i in range(start, len(self.body)) if self.body[i] not in nodes), None)

    def _fsdp_reduce_scatters(self) -> list[Node]:
        return [n for n in self.body if is_reduce_scatter(n) and is_fsdp_collective(n)]

    def issue_reduce_scatters_early(self) -> None:
        for rs in self._fsdp_reduce_scatters():
            index = self.index
            producer = max(rs.all_input_nodes, key=lambda n: index.get(n, -1))
            if producer not in index or index[producer] + 1 == index[rs]:
                continue
            move = self.order.moved([rs], self.body[index[producer] + 1])
            # Only a collective limit needs the candidate measured; the caller re-measures after.
            if self.max_collectives_in_flight is not None:
                if self._too_many_in_flight(self._measure(move)[2]):
                    continue
            self.order.accept(move)
            rs.meta[PASS_META] = "reorder_for_overlap"

    def _hoist_candidate(self, earlier: Node, later: Node) -> Optional[tuple[_Move, list[Node]]]:
        """(the move of `later` and what computes its input before what computes only `earlier`'s
        input, the nodes moved), or None when that input is not ready there."""
        index = self.index
        own = _own_inputs(earlier, index)
        if not own:
            return None
        barrier = _last_barrier(later, index[own[0]], index)
        own = [n for n in own if index[n] > barrier]
        if not own:
            return None
        moving = _inputs_after(later, index[own[0]], index)
        if moving is None or not set(moving).isdisjoint(own):
            return None
        return self.order.moved(moving, own[0]), moving

    def hoist_reduce_scatters(self) -> None:
        """RS(i+1), with what computes its input, moves before what computes only RS(i)'s input,
        when that hides more; it keeps moving up while it does. At the end of a backward the root's
        bucket (embedding and output weights, the largest) needs only the first block's input
        gradient, so it is issued before the first block's weight gradients are reduced into their
        bucket, and runs under that."""
        found_reduces = self._fsdp_reduce_scatters()  # the same nodes throughout, in the current order
        k = 1
        while k < len(reduces := sorted(found_reduces, key=self.index.__getitem__)):
            earlier, later = reduces[k - 1], reduces[k]
            found = self._hoist_candidate(earlier, later)
            if found is not None:
                move, moving = found
                why, exposed = self._check(move)
                if why is None and exposed < self.exposed - 1e-12:
                    self._accept(move)
                    self.report.hoisted.append(later.name)
                    for n in moving:
                        n.meta[PASS_META] = "reorder_for_overlap"
                    k = max(k - 1, 1)
                    continue
                if why is not None:
                    self.report.rejected.append((later.name, f"not issued before {earlier.name}: {why}"))
                    logger.debug("fsdp_graph::reorder (%s) not issued before %s: %s", later.name, earlier.name, why)
            k += 1

    def sink_waits(self) -> None:
        """Wait for RS(i) just before RS(i+1) or RS(i+2) is issued, or at the end: of the places
        that pass the limits, the one with the least exposed communication, the earliest on ties
        (its full-size gradient input dies soonest). When none passes the memory limits, as late
        before RS(i+1) as they allow (`_sink_partway`): some overlap rather than none."""
        reduces = [n for n in self.body if is_fsdp_collective(n) and not is_all_gather(n)]
        index = self.index
        for k, rs in enumerate(reduces):
            wait = wait_of(rs)
            tail = _output_tail(wait) if wait is not None else None
            if tail is None:
                continue
            tail.sort(key=index.__getitem__)
            ready = _last_outside_input(tail, index)
            best: Optional[tuple[float, _Move]] = None
            reasons = []
            for anchor in reduces[k + 1 : k + 3] + [None]:
                if anchor is not None and (anchor in tail or index[anchor] <= index[tail[0]]):
                    continue  # (HSDP: the all-reduce that follows a reduce-scatter is in its tail)
                if anchor is not None and ready >= index[anchor]:
                    continue  # a tail node also reads something computed after the anchor
                move = self.order.moved(tail, anchor)
                why, exposed = self._check(move)
                if why is not None:
                    reasons.append(why)
                elif exposed <= self.exposed + 1e-12 and (best is None or exposed < best[0] - 1e-12):
                    best = (exposed, move)
            if best is None and reasons:
                best = self._sink_partway(tail, reduces[k + 1] if k + 1 < len(reduces) else None)
            if best is not None:
                self._accept(best[1])
                self.report.sunk_waits.append(rs.name)
                for n in tail:
                    n.meta[PASS_META] = "reorder_for_overlap"
            else:
                reason = "; ".join(reasons) or "sinking its wait exposes more communication"
                self.report.rejected.append((rs.name, f"wait not sunk: {reason}"))
                logger.debug("fsdp_graph::reorder (%s) wait not sunk: %s", rs.name, reason)

    def _sink_partway(self, tail: list[Node], until: Optional[Node]) -> Optional[tuple[float, _Move]]:
        """The latest compute node before `until` (the next reduce-scatter, or the end) to move
        `tail` (a wait and what only feeds outputs from it) before, such that the limits hold and
        less communication is exposed; found by bisection, as memory grows the later the wait."""
        index = self.index
        end = index[until] if until is not None else len(self.body)
        ready = max(index[tail[-1]], _last_outside_input(tail, index))
        positions = [i for i in range(ready + 1, end) if _kind(self.body[i]) is OpKind.COMPUTE]
        best: Optional[tuple[float, _Move]] = None
        lo, hi = 0, len(positions) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            move = self.order.moved(tail, self.body[positions[mid]])
            why, exposed = self._check(move)
            if why is None:
                if exposed < self.exposed - 1e-12:
                    best = (exposed, move)
                lo = mid + 1
            else:
                hi = mid - 1
        return best

    def prefetch_all_gathers(self) -> None:
        gathers = [n for n in self.body if is_all_gather(n) and is_fsdp_collective(n) and wait_of(n) is not None]
        index = self.index
        for j, ag in enumerate(gathers):
            best: Optional[tuple[float, int, _Move]] = None
            reasons = []
            for depth in range(1, _MAX_PREFETCH_DEPTH + 1):
                anchor = wait_of(gathers[j - depth]) if j - depth >= 0 else (self.body[0] if j - depth == -1 else None)
                if anchor is None or index[anchor] >= index[ag]:
                    continue
                moving = _inputs_after(ag, index[anchor], index)
                if moving is None:
                    reasons.append(f"depth {depth}: its inputs are not ready")
                    continue
                anchor = self._first_not_in(index[anchor], moving)
                if anchor is None or index[anchor] > index[moving[0]]:
                    continue
                move = self.order.moved(moving, anchor)
                why, exposed = self._check(move)
                if why is not None:
                    reasons.append(f"depth {depth}: {why}")
                    continue
                if exposed < self.exposed - 1e-12 and (best is None or exposed < best[0] - 1e-12):
                    best = (exposed, depth, move)
            if best is None and j >= 1:
                best = self._prefetch_after_wait(ag, wait_of(gathers[j - 1]), reasons)
            if best is None:
                self.report.prefetch_depth[ag.name] = 0
                if reasons:
                    self.report.rejected.append((ag.name, "not prefetched: " + "; ".join(reasons)))
                    logger.debug("fsdp_graph::reorder (%s) not prefetched: %s", ag.name, "; ".join(reasons))
                continue
            _, depth, move = best
            self._accept(move)
            self.report.prefetch_depth[ag.name] = depth
            ag.meta[PASS_META] = "reorder_for_overlap"

    def _prefetch_after_wait(self, ag: Node, wait: Node, reasons: list[str]) -> Optional[tuple[float, int, _Move]]:
        """AG(i+1) issued just after wait(AG(i)) instead of before it: still under compute(i), with
        one collective in flight, where issuing it earlier was rejected (e.g. by `max_collectives_in_flight`). Returns
        (exposed, 1, move) when that hides some of it, else None."""
        index = self.index
        moving = _inputs_after(ag, index[wait], index)
        if not moving:  # an input that must stay put, or AG(i+1) is issued before the wait already
            return None
        anchor = self._first_not_in(index[wait] + 1, moving)
        if anchor is None or index[anchor] > index[moving[0]]:
            return None
        move = self.order.moved(moving, anchor)
        why, exposed = self._check(move)
        if why is not None:
            reasons.append(f"after the previous wait: {why}")
            return None
        return (exposed, 1, move) if exposed < self.exposed - 1e-12 else None

    def apply(self, gm: GraphModule) -> None:
        output = self.order.tail[0]
        for node in self.body:
            output.prepend(node)
        self._measure_current()
        self.report.peak_bytes_after, self.report.exposed_s_after = self.peak, self.exposed
        flight = self.in_flight
        self.report.max_in_flight_bytes, self.report.max_in_flight_collectives, self.report.max_in_flight_all_gathers = flight
        self.report.num_simulated = self.order.measured.num_simulated


def reorder_for_overlap(
    gm: GraphModule,
    cost_model: CostModel,
    max_bytes_in_flight: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    max_collectives_in_flight: Optional[int] = None,
) -> GraphModule:
    """Schedule the graph's collectives for overlap; see the module docstring for the schedule.
    `max_collectives_in_flight` None: no limit (on gloo too: [Note: All-gathers on gloo] in
    passes/gloo.py).

    Assumes: a partitioned forward or backward graph whose collectives are each waited on once.
    Guarantees: the same nodes with the same arguments, in a topological order; only all-gathers
    with the data preparation feeding them, reduce-scatters with the nodes computing their input,
    and reduce-scatter waits with what only feeds the outputs from them move.
    `gm.meta[SCHEDULE_META]` holds a `ScheduleReport`.
    """
    if not any(is_collective(n) for n in gm.graph.nodes):
        return gm
    scheduler = _Scheduler(gm, cost_model, max_bytes_in_flight, memory_budget_bytes, max_collectives_in_flight)
    scheduler.issue_reduce_scatters_early()
    scheduler._measure_current()
    scheduler.hoist_reduce_scatters()
    scheduler.sink_waits()
    scheduler.prefetch_all_gathers()
    scheduler.apply(gm)
    gm.meta[SCHEDULE_META] = scheduler.report
    r = scheduler.report
    logger.debug(
        "fsdp_graph::reorder prefetch %s, %d reduce-scatters hoisted, %d waits sunk, exposed %.3g -> %.3g s, peak %d -> %d bytes",
        r.prefetch_depth, len(r.hoisted), len(r.sunk_waits), r.exposed_s_before, r.exposed_s_after, r.peak_bytes_before,
        r.peak_bytes_after,
    )
    return gm
