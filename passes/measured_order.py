"""One order of a graph's nodes, measured so that an order differing from it in one window costs
about the window's length to measure, not the graph's.

[Note: Measuring a move]
The reorder pass tries moves: a few nodes taken from their places and put back together before
another node. The candidate order is the current one outside the positions between the first
and the last place a node left or entered (the window), and a permutation of the same nodes
inside it. A whole measure (`OrderCost.measure`) of every candidate made the pass quadratic in
depth: the moves grow with the number of blocks, and so does each measure. `MeasuredOrder` keeps
what the current order's measure found at every position and measures a candidate from the state
before its window, over the window only:
- memory and collectives in flight (integer bytes and counts): after the window, the same nodes
  have been allocated, issued and waited on, and a storage whose last reader lies after the window
  keeps it, so the live bytes and the collectives in flight are the current order's from there on.
  The candidate's peak is the largest of the current order's peak before the window, the window's,
  and the current order's after it (range maxima over positions, `_MaxTree`).
- time: the clocks after the window differ, by as much as the move hides or exposes. But the rest
  of the order is the same, and each of its steps is a sum or a maximum: the compute clock at the
  end is max(clock + A, each stream's free time + A_s, each collective in flight's end + A_k),
  where the As are the longest compute-and-communication paths from that point of the current
  order to its end (the max-plus form of the simulator's recurrence). The current order's As at
  every position come from one backward pass over it. With exact arithmetic ([Note: Exact simulated
  time] in passes/simulator.py) that is the clock a whole simulation reaches, and the exposed time
  is that clock less the compute time, which no order changes.
The clocks before a window (forward) and the As after it (backward) are found lazily: accepting a
move invalidates the clocks from its window on and the As up to its window's end, and the passes
walk the graph in order, so the next windows need little of them again.
So a measure costs its window. Most windows span a block or two (a prefetch, a wait sunk to the
next reduce-scatters); the one kind that grows with depth is a reduce-scatter's wait tried at the
graph's end, whose window runs from the wait to the end: one per reduce-scatter, a term in depth
squared that remains, at a small cost per position.
tests/test_reorder_scaling.py checks moves against `simulate`, and the counts' growth with depth.

Assumes topological orders (every node after its inputs) and at most one wait per collective;
with several, every measure is a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .program import OpKind, seconds
from .timeline import OrderCost, Timeline

_NEVER = float("-inf")  # no path from here to the end of the compute stream


class _MaxTree:
    """Largest value over a range of positions, with whole ranges reassigned; values start at 0."""

    def __init__(self, size: int) -> None:
        self.size = 1
        while self.size < max(size, 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)

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
    """A measure of an order that is the current one but for positions lo..hi-1 (`window`): its
    numbers, and what `MeasuredOrder.accept` keeps of it (each list has one entry per position)."""

    window: list
    lo: int
    hi: int
    clocks: list[int]  # compute clock after the node (ticks)
    free: list[tuple]  # each stream's free time after the node
    in_flight: list[tuple]  # (collective, its end) issued and not yet waited on after the node
    live: list[int]  # live bytes after the node
    peaks: list[int]  # live bytes once the node allocated (0: it allocates nothing)
    pending: list[tuple[int, int, int]]  # (bytes, collectives, all-gathers) in flight after the node
    issued: list[tuple[int, int, int]]  # those at a collective's issue, (0, 0, 0) elsewhere
    last_use: dict  # storages whose last use is in the window -> its position
    peak: int
    exposed: float
    flight: tuple[int, int, int]


class MeasuredOrder:
    """The current order of a graph's nodes (keys of an `OrderCost`) and its measure, with
    `measure` for an order that differs in one window and `accept` to make that order the current
    one. See [Note: Measuring a move].

    Attributes: order (the current order), peak, exposed, flight (what `OrderCost.measure` gives
    for it), num_simulated (node positions simulated so far, forward or backward, the first whole
    measure included: what the reorder pass's time grows with).
    """

    def __init__(self, cost: OrderCost, order: list) -> None:
        self._cost = cost
        facts = self._facts = cost.facts
        self.order = list(order)
        self.num_simulated = 0
        n = len(self.order)
        self._num_streams = len(cost.streams)
        self._wait_of: dict = {}  # collective -> its wait
        waits: dict = {}
        for key, f in facts.items():
            if f.waited is not None:
                self._wait_of[f.waited] = key
                waits[f.waited] = waits.get(f.waited, 0) + 1
        # A collective waited on more than once keeps its inputs until its last wait: measured whole.
        self._whole = any(count > 1 for count in waits.values())
        self._compute_ticks = sum(f.duration for f in facts.values() if f.kind is OpKind.COMPUTE)
        self._position = {key: i for i, key in enumerate(self.order)}
        # Memory and collectives in flight, after each position: always up to date.
        self._live = [0] * n
        self._pending: list[tuple[int, int, int]] = [(0, 0, 0)] * n
        self._last_use: dict = {}  # storage -> the position of its last use
        self._peaks = _MaxTree(n)
        self._issued = [_MaxTree(n) for _ in range(3)]
        # Clocks after each position, up to date before position `_forward`.
        self._clock = [0] * n
        self._free: list[tuple] = [()] * n
        self._in_flight: list[tuple] = [()] * n
        self._forward = 0
        # The As of [Note: Measuring a move] for the state before each position (n: the end), up to
        # date from position `_backward` on: (A of the compute clock, A of each stream's free time).
        self._to_end: list[tuple[int, tuple]] = [(0, ())] * (n + 1)
        self._to_end[n] = (0, (_NEVER,) * self._num_streams)
        self._backward = n
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

    def _timeline_before(self, lo: int) -> Timeline:
        """The current order's run after position lo-1, as a `Timeline` to step on from position lo.
        Its `uses`, `worst` and `exposed` count from lo."""
        n = len(self.order)
        if lo == 0:
            return Timeline(self._facts, n, self._num_streams)
        return Timeline(self._facts, n, self._num_streams, self._clock[lo - 1], list(self._free[lo - 1]),
                        dict(self._in_flight[lo - 1]), self._pending[lo - 1])

    def _step_over(self, run: Timeline, keys: list, lo: int) -> tuple[list, list, list, list, list]:
        """Step `run` over `keys` at positions lo, lo+1, ...; after each: the compute clock, each
        stream's free time, the collectives in flight with their ends, the (bytes, collectives,
        all-gathers) in flight, and those at a collective's issue ((0, 0, 0) elsewhere)."""
        clocks, frees, flights, pendings, issued = [], [], [], [], []
        free_now, flight_now = tuple(run.free), tuple(run.in_flight.items())
        step, collective = run.step, OpKind.COLLECTIVE
        for i, key in enumerate(keys, lo):
            f = step(i, key)
            at_issue = (0, 0, 0)
            if f.kind is collective:
                free_now, flight_now = tuple(run.free), tuple(run.in_flight.items())
                at_issue = (run.pending_bytes, run.pending_count, run.pending_gathers if f.is_all_gather else 0)
            elif f.waited is not None:
                flight_now = tuple(run.in_flight.items())
            clocks.append(run.clock)
            frees.append(free_now)
            flights.append(flight_now)
            pendings.append((run.pending_bytes, run.pending_count, run.pending_gathers))
            issued.append(at_issue)
        self.num_simulated += len(keys)
        return clocks, frees, flights, pendings, issued

    def _run(self, window: list, lo: int, hi: int) -> _Run:
        """Measure the order that is `window` at positions lo..hi-1 and the current order elsewhere,
        with `OrderCost.measure`'s step over the window."""
        n = len(self.order)
        self._run_forward(lo)
        self._run_backward(hi)
        run = self._timeline_before(lo)
        clocks, frees, flights, pendings, issued = self._step_over(run, window, lo)
        # Memory: a storage whose last use is after the window keeps it; the others die in it.
        base_last = self._last_use
        last_use = {owner: i for owner, i in run.uses.items() if base_last.get(owner, -1) < hi}
        lives, peaks = run.live_bytes(window, lo, self._live[lo - 1] if lo else 0, run.freed(last_use))
        peak = max(self._peaks.max(0, lo), max(peaks, default=0), self._peaks.max(hi, n))
        flight = tuple(
            max(tree.max(0, lo), max((x[c] for x in issued), default=0), tree.max(hi, n))
            for c, tree in enumerate(self._issued)
        )
        return _Run(list(window), lo, hi, clocks, frees, flights, lives, peaks, pendings, issued, last_use, peak,
                    seconds(self._final_clock(run, hi) - self._compute_ticks), flight)

    def _final_clock(self, run: Timeline, hi: int) -> int:
        """The compute clock at the end of the order, from `run` after position hi-1 and the As there."""
        to_end, position, wait_of = self._to_end, self._position, self._wait_of
        clock_to_end, free_to_end = to_end[hi]
        final = run.clock + clock_to_end
        for s, a in enumerate(free_to_end):
            final = max(final, run.free[s] + a)
        for key, end in run.in_flight.items():  # waited on after the window
            if key in wait_of:
                final = max(final, end + to_end[position[wait_of[key]] + 1][0])
        return final

    def _run_forward(self, stop: int) -> None:
        """Bring the clocks after positions `_forward`..stop-1 up to date."""
        start = self._forward
        if stop <= start:
            return
        run = self._timeline_before(start)
        clocks, frees, flights, _, _ = self._step_over(run, self.order[start:stop], start)
        self._clock[start:stop], self._free[start:stop], self._in_flight[start:stop] = clocks, frees, flights
        self._forward = stop

    def _run_backward(self, start: int) -> None:
        """Bring the As before positions start..`_backward`-1 up to date, from the end backwards:
        a compute node adds its duration to the clock's A; a collective's issue makes its end, which
        its stream's later collectives and its wait (through the clock's A after the wait) take up;
        a wait passes the clock's A on to its collective's end."""
        if start >= self._backward:
            return
        facts, to_end = self._facts, self._to_end
        position, wait_of = self._position, self._wait_of
        compute, collective = OpKind.COMPUTE, OpKind.COLLECTIVE
        for p in range(self._backward - 1, start - 1, -1):
            key = self.order[p]
            f = facts[key]
            clock_to_end, free_to_end = to_end[p + 1]
            if f.kind is compute:
                to_end[p] = (clock_to_end + f.duration, free_to_end)
            elif f.kind is collective:
                s = f.stream
                end_to_end = free_to_end[s]
                if key in wait_of:
                    end_to_end = max(end_to_end, to_end[position[wait_of[key]] + 1][0])
                through = f.duration + end_to_end
                to_end[p] = (max(clock_to_end, through), free_to_end[:s] + (through,) + free_to_end[s + 1 :])
            else:
                to_end[p] = (clock_to_end, free_to_end)
        self.num_simulated += self._backward - start
        self._backward = start

    def _keep(self, run: _Run) -> None:
        lo, hi = run.lo, run.hi
        self.order[lo:hi] = run.window
        for i in range(lo, hi):
            self._position[self.order[i]] = i
        self._clock[lo:hi] = run.clocks
        self._free[lo:hi] = run.free
        self._in_flight[lo:hi] = run.in_flight
        self._forward = hi  # the clocks after the window moved with it
        self._backward = max(self._backward, hi)  # the As before its end changed with it
        self._live[lo:hi] = run.live
        self._pending[lo:hi] = run.pending
        self._last_use.update(run.last_use)
        self._peaks.assign(lo, run.peaks)
        for c, tree in enumerate(self._issued):
            tree.assign(lo, [x[c] for x in run.issued])
        self.peak, self.exposed, self.flight = run.peak, run.exposed, run.flight
