"""One order of a graph's nodes, measured so that an order differing from it in one window costs
about the window's length to measure, not the graph's.

[Note: Measuring a move]
The reorder pass tries moves: a few nodes taken from their places and put back together before
another node. The candidate order is the current one outside the positions between the first
and the last place a node left or entered (the window), and a permutation of the same nodes
inside it. A full measure (`OrderCost.measure`) of every candidate made the pass quadratic in
depth: the moves grow with the number of blocks, and so does each measure. `MeasuredOrder` keeps,
for the current order, the state of every quantity `OrderCost.measure` tracks after each position,
and measures a candidate from the state before its window:
- memory (integer bytes) and collectives in flight: after the window, the same nodes have been
  allocated, issued and waited on, and a storage whose last reader lies after the window keeps
  it, so the live bytes and the collectives in flight are the current order's from there on. The
  candidate's peak is the largest of the current order's peak before the window, the window's,
  and the current order's after it (range maxima over the positions, `_MaxTree`).
- time (float seconds): the clocks can differ after the window, by a stall that moved or by the
  rounding of the same durations added in another order. The candidate's clocks run on past the
  window until its state is the current order's bit for bit: the compute clock, every stream's
  free time, and every collective in flight finishing when it does in the current order. From
  there on every float the candidate computes is the current order's, so its exposed time is its
  own sum so far plus the current order's stalls after that point, added one by one in order.
So a candidate gets the numbers `OrderCost.measure` gives it, bit for bit (the same float
operations in the same order), and the reorder pass makes the same decisions.
tests/test_passes_schedule.py checks moves against `simulate`.

Assumes topological orders (every node after its inputs) and at most one wait per collective;
with several, every measure is a full one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Optional

from .simulator import OpKind, OrderCost


class _MaxTree:
    """Largest value over a range of positions, with whole ranges reassigned; values start at 0."""

    def __init__(self, values: list[int]) -> None:
        self.size = 1
        while self.size < max(len(values), 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        self.assign(0, values)

    def assign(self, lo: int, values: list[int]) -> None:
        """Positions lo, lo+1, ... take `values`."""
        if not values:
            return
        tree, size = self.tree, self.size
        tree[size + lo : size + lo + len(values)] = values
        left, right = (size + lo) // 2, (size + lo + len(values) - 1) // 2
        while left >= 1:
            for p in range(left, right + 1):
                a, b = tree[2 * p], tree[2 * p + 1]
                tree[p] = a if a > b else b
            left, right = left // 2, right // 2

    def max(self, lo: int, hi: int) -> int:
        """The largest value at positions lo..hi-1 (0 when empty)."""
        tree, best = self.tree, 0
        lo, hi = lo + self.size, hi + self.size
        while lo < hi:
            if lo & 1:
                best = max(best, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                best = max(best, tree[hi])
            lo, hi = lo // 2, hi // 2
        return best


@dataclass
class _Run:
    """A measure of positions lo..hi-1 (and the clocks on to `stop`) of an order that differs from
    the current one only there: its numbers, and what `MeasuredOrder.accept` keeps of it."""

    window: list
    lo: int
    hi: int
    stop: int  # the last position whose clocks were computed (>= hi - 1)
    clocks: list[float]  # lo..stop: compute clock after the node
    free: list[tuple]  # lo..stop: each stream's free time after the node
    stalls: list[float]  # lo..stop: the compute stream's wait at the node (0.0: none)
    ends: dict  # collectives issued at lo..stop -> when they finish
    live: list[int]  # lo..hi-1: live bytes after the node
    peaks: list[int]  # lo..hi-1: live bytes once the node allocated (0: it allocates nothing)
    pending: list[tuple[int, int, int]]  # lo..hi-1: (bytes, collectives, all-gathers) in flight after it
    issued: list[tuple[int, int, int]]  # lo..hi-1: those at a collective's issue, (0, 0, 0) elsewhere
    last_use: dict  # storages the window uses -> their last reader's position
    peak: int
    exposed: float
    flight: tuple[int, int, int]


class MeasuredOrder:
    """The current order of a graph's nodes (keys of an `OrderCost`) and its measure, with
    `measure` for an order that differs in one window and `accept` to make that order the current
    one. See [Note: Measuring a move].

    Attributes: order (the current order), peak, exposed, flight (what `OrderCost.measure` gives
    for it), num_simulated (positions simulated so far, the full first measure included: what the
    reorder pass's cost grows with).
    """

    def __init__(self, cost: OrderCost, order: list) -> None:
        self._cost = cost
        self._facts = cost._facts
        self.order = list(order)
        self.num_simulated = 0
        self._streams = sorted({f[2] for f in self._facts.values() if f[0] is OpKind.COLLECTIVE})
        self._stream_index = {s: i for i, s in enumerate(self._streams)}
        # A collective waited on more than once keeps its inputs until its last wait: measured whole.
        waits: dict = {}
        for f in self._facts.values():
            if f[0] is OpKind.WAIT and f[7] is not None:
                waits[f[7]] = waits.get(f[7], 0) + 1
        self._whole = any(count > 1 for count in waits.values())
        self._collective = {key for key, f in self._facts.items() if f[0] is OpKind.COLLECTIVE}
        n = len(self.order)
        self._clock: list[float] = [0.0] * n
        self._free: list[tuple] = [()] * n
        self._stall: list[float] = [0.0] * n
        self._stall_at: list[int] = []  # positions with a stall, ascending
        self._exposed_through: list[float] = []  # exposed seconds through each of those
        self._end: dict = {}
        self._live: list[int] = [0] * n
        self._pending: list[tuple[int, int, int]] = [(0, 0, 0)] * n
        self._last_use: dict = {}
        self._peaks = _MaxTree([0] * n)
        self._issued = [_MaxTree([0] * n) for _ in range(3)]
        if self._whole:
            self.num_simulated += n
            self.peak, self.exposed, self.flight = cost.measure(self.order)
        else:
            self._keep(self._run(self.order, 0, n))

    def measure(self, window: list, lo: int, hi: int) -> tuple[int, float, tuple[int, int, int]]:
        """What `OrderCost.measure` gives for the current order with positions lo..hi-1 replaced by
        `window` (the same nodes in another order)."""
        if self._whole:
            self.num_simulated += len(self.order)
            return self._cost.measure(self.order[:lo] + list(window) + self.order[hi:])
        run = self._run(window, lo, hi)
        return run.peak, run.exposed, run.flight

    def accept(self, window: list, lo: int, hi: int) -> None:
        """Make the current order the one with positions lo..hi-1 replaced by `window`."""
        if self._whole:
            self.order[lo:hi] = window
            self.num_simulated += len(self.order)
            self.peak, self.exposed, self.flight = self._cost.measure(self.order)
            return
        self._keep(self._run(window, lo, hi))

    def _exposed_before(self, position: int) -> float:
        """Exposed seconds through position-1 of the current order, summed as `OrderCost` sums them."""
        k = bisect_left(self._stall_at, position)
        return self._exposed_through[k - 1] if k else 0.0

    def _run(self, window: list, lo: int, hi: int) -> _Run:
        """Measure the order that is `window` at positions lo..hi-1 and the current order elsewhere.
        The arithmetic is `OrderCost.measure`'s, in the same order."""
        facts, stream_index, base_end, collective_keys = self._facts, self._stream_index, self._end, self._collective
        compute, collective, wait, output = OpKind.COMPUTE, OpKind.COLLECTIVE, OpKind.WAIT, OpKind.OUTPUT
        n = len(self.order)
        if lo == 0:
            clock = exposed = 0.0
            free = [0.0] * len(self._streams)
            pending_bytes = pending_count = pending_gathers = live = 0
        else:
            clock, free, exposed = self._clock[lo - 1], list(self._free[lo - 1]), self._exposed_before(lo)
            pending_bytes, pending_count, pending_gathers = self._pending[lo - 1]
            live = self._live[lo - 1]
        ends: dict = {}
        diverged: set = set()  # issued here, finishing at another time than in the current order, not yet waited on
        uses: dict = {}  # storage -> its last use in the window
        scratch_at: dict[int, int] = {}  # position -> scratch bytes taken (+) or given back (-)
        clocks, frees, stalls, pendings, issued = [], [], [], [], []
        for i in range(lo, hi):
            key = window[i - lo]
            kind, duration, stream, num_bytes, is_all_gather, allocates, reads, waited, scratch = facts[key]
            stall = 0.0
            at_issue = (0, 0, 0)
            if allocates >= 0 and key not in uses:
                uses[key] = i
            if kind is compute:
                clock += duration
            elif kind is collective:
                s = stream_index[stream]
                start = max(clock, free[s])
                end = free[s] = ends[key] = start + duration
                if end != base_end.get(key):
                    diverged.add(key)
                pending_bytes += num_bytes
                pending_count += 1
                if is_all_gather:
                    pending_gathers += 1
                at_issue = (pending_bytes, pending_count, pending_gathers if is_all_gather else 0)
                if scratch:
                    scratch_at[i] = scratch
            elif kind is wait and waited in collective_keys:
                finish = ends[waited] if waited in ends else base_end[waited]
                if finish > clock:
                    stall = finish - clock
                    exposed += stall
                    clock = finish
                diverged.discard(waited)
                waited_facts = facts[waited]
                pending_bytes -= waited_facts[3]
                pending_count -= 1
                if waited_facts[4]:
                    pending_gathers -= 1
                if waited_facts[8]:
                    scratch_at[i] = -waited_facts[8]
                for owner in waited_facts[6]:  # a collective reads its inputs until its wait
                    if uses.get(owner, -1) < i:
                        uses[owner] = i
            until = n if kind is output else i
            for owner in reads:
                if uses.get(owner, -1) < until:
                    uses[owner] = until
            clocks.append(clock)
            frees.append(tuple(free))
            stalls.append(stall)
            pendings.append((pending_bytes, pending_count, pending_gathers))
            issued.append(at_issue)
        # Memory: a storage whose last use is after the window keeps it; the others die in it.
        base_last, freed, last_use = self._last_use, {}, {}
        for owner, i in uses.items():
            last = base_last.get(owner, -1)
            if last >= hi:
                continue
            last_use[owner] = i
            freed[i] = freed.get(i, 0) + facts[owner][5]
        lives, peaks = [], []
        window_peak = 0
        for i in range(lo, hi):
            scratch = scratch_at.get(i, 0)
            allocated = max(facts[window[i - lo]][5], 0) + max(scratch, 0)
            at_peak = 0
            if allocated:
                live += allocated
                at_peak = live
                if live > window_peak:
                    window_peak = live
            live -= freed.get(i, 0) - min(scratch, 0)
            lives.append(live)
            peaks.append(at_peak)
        # Time: run on with the current order's nodes until the state is the current order's.
        stop = hi - 1
        if hi < n and not (stop >= lo and self._same_state(stop, clock, free, diverged)):
            for i in range(hi, n):
                stop = i
                kind, duration, stream, _, _, _, _, waited, _ = facts[self.order[i]]
                stall = 0.0
                if kind is compute:
                    clock += duration
                elif kind is collective:
                    key = self.order[i]
                    s = stream_index[stream]
                    start = max(clock, free[s])
                    end = free[s] = ends[key] = start + duration
                    if end != base_end[key]:
                        diverged.add(key)
                elif kind is wait and waited in collective_keys:
                    finish = ends[waited] if waited in ends else base_end[waited]
                    if finish > clock:
                        stall = finish - clock
                        exposed += stall
                        clock = finish
                    diverged.discard(waited)
                clocks.append(clock)
                frees.append(tuple(free))
                stalls.append(stall)
                if self._same_state(i, clock, free, diverged):
                    break
        for k in range(bisect_right(self._stall_at, stop), len(self._stall_at)):
            exposed += self._stall[self._stall_at[k]]
        self.num_simulated += stop + 1 - lo
        peak = max(self._peaks.max(0, lo), window_peak, self._peaks.max(hi, n))
        flight = tuple(
            max(tree.max(0, lo), max((x[c] for x in issued), default=0), tree.max(hi, n))
            for c, tree in enumerate(self._issued)
        )
        return _Run(list(window), lo, hi, stop, clocks, frees, stalls, ends, lives, peaks, pendings, issued,
                    last_use, peak, exposed, flight)

    def _same_state(self, i: int, clock: float, free: list[float], diverged: set) -> bool:
        """Whether the clocks after position i are the current order's, bit for bit."""
        return clock == self._clock[i] and not diverged and tuple(free) == self._free[i]

    def _keep(self, run: _Run) -> None:
        lo, hi, stop = run.lo, run.hi, run.stop
        self.order[lo:hi] = run.window
        self._clock[lo : stop + 1] = run.clocks
        self._free[lo : stop + 1] = run.free
        self._stall[lo : stop + 1] = run.stalls
        self._end.update(run.ends)
        self._live[lo:hi] = run.live
        self._pending[lo:hi] = run.pending
        self._last_use.update(run.last_use)
        self._peaks.assign(lo, run.peaks)
        for c, tree in enumerate(self._issued):
            tree.assign(lo, [x[c] for x in run.issued])
        # The stalls from lo on, and the exposed seconds through each, summed in order.
        k = bisect_left(self._stall_at, lo)
        kept = [p for p in self._stall_at[k:] if p > stop]
        self._stall_at[k:] = [p for p in range(lo, stop + 1) if self._stall[p]] + kept
        del self._exposed_through[k:]
        exposed = self._exposed_through[-1] if k else 0.0
        for p in self._stall_at[k:]:
            exposed += self._stall[p]
            self._exposed_through.append(exposed)
        self.peak, self.exposed, self.flight = run.peak, run.exposed, run.flight
