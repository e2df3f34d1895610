"""One step of the simulator, and the orders of one graph's nodes it measures: each node's
`NodeFacts` found once, and `Timeline.step`, which `simulate`, `memory_profile` (passes/simulator.py),
`OrderCost.measure` and `MeasuredOrder` (passes/measured_order.py) all fold over an order.
See [Note: Simulator model] and [Note: Exact simulated time] in passes/simulator.py."""

from __future__ import annotations

from typing import NamedTuple, Optional

from .cost_model import CollectiveKind, CostModel
from .program import OpKind, _allocates_apart, saved_inputs, seconds, ticks


_COMPUTE, _COLLECTIVE, _OUTPUT = OpKind.COMPUTE, OpKind.COLLECTIVE, OpKind.OUTPUT  # read once per step


class NodeFacts(NamedTuple):
    """What the simulator knows of one node of a graph, whatever its position in an order: found once
    per graph (`OrderCost`), read by `Timeline.step` at each position of each order. See [Note:
    Simulator model].

    Attributes:
        kind: the node's `OpKind`.
        duration: ticks it takes on its stream (compute nodes and collectives; 0 for the others).
        stream: a collective's communication stream (its parallelism), as an index into
            `OrderCost.streams`; 0 for the others.
        num_bytes: a collective's bytes (`OpFacts.collective_bytes`), in flight from its issue to its wait.
        is_all_gather: whether it is an all-gather.
        allocates: bytes of the storage it allocates at its position; -1 where it allocates none (a
            view, a wait, an input that is the caller's, an `out=` op).
        reads: the storages it reads, each named by the key of the node that allocated it; a
            collective reads them until its wait.
        waited: a wait's collective (its key); None for the others.
        scratch: what it holds besides its output: a collective from its issue to its wait, a compile
            region's call while it runs (`Op.scratch_bytes`).
    """

    kind: OpKind
    duration: int
    stream: int
    num_bytes: int
    is_all_gather: bool
    allocates: int
    reads: tuple
    waited: object
    scratch: int


class Timeline:
    """A simulated run of an order of a graph's nodes after some of its positions: the state that
    `step` advances by one node. `simulate`, `memory_profile`, `OrderCost.measure` and
    `MeasuredOrder` (over a window, from a state it kept) all fold this one step over an order. Times
    are ticks ([Note: Exact simulated time]).

    Attributes:
        facts: each node's `NodeFacts`, by key.
        end: the order's length; what the output reads lives until there.
        clock: the compute stream's clock.
        free: when each communication stream's last collective ends, by stream index.
        in_flight: the collectives issued and not yet waited on, in issue order, each with its end.
        pending_bytes, pending_count, pending_gathers: the bytes, collectives and all-gathers in flight.
        worst: the most (bytes, collectives, all-gathers) in flight at any issue of this run.
        exposed: the compute stream's stalls at waits in this run.
        uses: storage -> the position of its last reader in this run (a collective's reads last
            until its wait).
        scratch_at: position -> scratch bytes taken there (+: a collective's issue, a compile
            region's call) or given back (-: a collective's wait).
    """

    __slots__ = ("facts", "end", "clock", "free", "in_flight", "pending_bytes", "pending_count", "pending_gathers",
                 "worst", "exposed", "uses", "scratch_at")

    def __init__(self, facts: dict, end: int, num_streams: int, clock: int = 0, free: Optional[list] = None,
                 in_flight: Optional[dict] = None, pending: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.facts, self.end, self.clock = facts, end, clock
        self.free = free if free is not None else [0] * num_streams
        self.in_flight = in_flight if in_flight is not None else {}
        self.pending_bytes, self.pending_count, self.pending_gathers = pending
        self.worst = (0, 0, 0)
        self.exposed = 0
        self.uses: dict = {}
        self.scratch_at: dict[int, int] = {}

    def step(self, i: int, key) -> NodeFacts:
        """Run node `key` at position `i`; returns its facts."""
        f = self.facts[key]
        kind, uses = f.kind, self.uses
        if f.allocates >= 0 and key not in uses:
            uses[key] = i
        if kind is _COMPUTE:
            self.clock += f.duration
            if f.scratch:  # a compile region's body, held while it runs
                self.scratch_at[i] = f.scratch
        elif kind is _COLLECTIVE:
            self._issue(i, key, f)
        elif f.waited is not None:
            self._wait(i, f.waited)
        until = self.end if kind is _OUTPUT else i
        for owner in f.reads:
            if uses.get(owner, -1) < until:
                uses[owner] = until
        return f

    def _issue(self, i: int, key, f: NodeFacts) -> None:
        free = self.free
        free[f.stream] = self.in_flight[key] = max(self.clock, free[f.stream]) + f.duration
        self.pending_bytes += f.num_bytes
        self.pending_count += 1
        self.pending_gathers += f.is_all_gather
        self.worst = (max(self.worst[0], self.pending_bytes), max(self.worst[1], self.pending_count),
                      max(self.worst[2], self.pending_gathers) if f.is_all_gather else self.worst[2])
        if f.scratch:
            self.scratch_at[i] = f.scratch

    def _wait(self, i: int, waited) -> None:
        f = self.facts[waited]
        if waited in self.in_flight:  # its first wait
            finish = self.in_flight.pop(waited)
            if finish > self.clock:
                self.exposed += finish - self.clock
                self.clock = finish
            self.pending_bytes -= f.num_bytes
            self.pending_count -= 1
            self.pending_gathers -= f.is_all_gather
            if f.scratch:
                self.scratch_at[i] = -f.scratch
        uses = self.uses
        for owner in f.reads:  # a collective reads its inputs until its wait
            if uses.get(owner, -1) < i:
                uses[owner] = i

    def freed(self, last_use: dict) -> dict[int, int]:
        """Position -> the bytes of the storages in `last_use` (storage -> position of its last reader)
        that die there."""
        freed: dict[int, int] = {}
        for owner, i in last_use.items():
            freed[i] = freed.get(i, 0) + self.facts[owner].allocates
        return freed

    def live_bytes(self, keys: list, lo: int, live: int, freed: dict[int, int]) -> tuple[list[int], list[int]]:
        """Live bytes after each node of `keys`, at positions lo, lo+1, ..., from `live` before them and
        the bytes `freed` at each position; and the live bytes once each node allocated (0 where it
        allocates nothing)."""
        facts, scratch_at = self.facts, self.scratch_at
        lives, peaks = [], []
        for i, key in enumerate(keys, lo):
            f = facts[key]
            allocated = f.allocates if f.allocates > 0 else 0
            scratch = scratch_at.get(i, 0) if scratch_at else 0
            if scratch > 0:  # a collective's issue, a compile region's call
                allocated += scratch
            at_peak = 0
            if allocated:
                live += allocated
                at_peak = live
            live -= freed.get(i, 0)
            if scratch < 0:  # a collective's wait gives its scratch back
                live += scratch
            if f.kind is _COMPUTE:  # a compile region's body, held while it ran
                live -= f.scratch
            lives.append(live)
            peaks.append(at_peak)
        return lives, peaks


class OrderCost:
    """What the scheduler compares between candidate orders of one graph's nodes, computed fast: the
    numbers `simulate` (exposed communication, peak memory), `in_flight` and `all_gathers_in_flight`
    give for the same program, bit for bit.

    [Note: Measuring candidate orders]
    The reorder pass measures one candidate order per move it tries, and the moves grow with the
    number of blocks, as does the program: a full `simulate` per candidate made the pass quadratic in
    depth. Everything that does not depend on the order is found
    once here, as each node's `NodeFacts`: its duration, its stream, which storage it allocates and
    which storages it reads (a view reads its base's; see [Note: Simulator model]). A whole order then
    costs one pass of `Timeline.step` over its nodes for the clocks and the collectives in flight
    and one sweep for live memory, with `simulate`'s exact arithmetic ([Note: Exact simulated time]),
    so the decisions are the ones whole simulations would make. The scheduler measures a move from
    the order it has measured, over the positions the move changes: [Note: Measuring a move] in
    passes/measured_order.py. tests/test_passes_schedule.py checks every order the scheduler
    measures against `simulate`.

    Assumes the orders are topological (every node after its inputs), as the scheduler's are.

    Attributes: facts (each node's `NodeFacts`, by key), streams (the communication streams, by
    index: the parallelisms of the collectives).
    """

    def __init__(self, ops: dict, cost_model: Optional[CostModel], callers_inputs: bool = False) -> None:
        """`ops`: every node of the graph (keys, any hashable, in a topological order) with its `Op`.
        `cost_model`: None for memory alone (every duration 0). `callers_inputs`: as in `memory_profile`."""
        owner_of: dict[str, object] = {}  # op name -> the key whose storage it is (absent: an input's or none)
        key_of = {op.name: key for key, op in ops.items()}
        owned = frozenset() if callers_inputs else saved_inputs(list(ops.values()))
        for key, op in ops.items():
            if _allocates_apart(op):
                owner_of[op.name] = key
            elif op.kind in (OpKind.VIEW, OpKind.WAIT):
                if op.inputs and op.inputs[0] in owner_of:
                    owner_of[op.name] = owner_of[op.inputs[0]]
            elif op.storage_of is not None:
                if op.storage_of in owner_of:
                    owner_of[op.name] = owner_of[op.storage_of]
            elif op.kind in (OpKind.COMPUTE, OpKind.COLLECTIVE) or op.name in owned:
                owner_of[op.name] = key
        self.streams = sorted({op.facts.parallelism for op in ops.values() if op.kind is OpKind.COLLECTIVE})
        stream_index = {stream: s for s, stream in enumerate(self.streams)}
        self.facts: dict[object, NodeFacts] = {}
        for key, op in ops.items():
            timed = cost_model is not None and op.kind in (OpKind.COMPUTE, OpKind.COLLECTIVE)
            waited = key_of.get(op.inputs[0]) if op.kind is OpKind.WAIT and op.inputs else None
            self.facts[key] = NodeFacts(
                kind=op.kind,
                duration=ticks(cost_model.seconds(op.facts)) if timed else 0,
                stream=stream_index[op.facts.parallelism] if op.kind is OpKind.COLLECTIVE else 0,
                num_bytes=op.facts.collective_bytes,
                is_all_gather=op.facts.collective is CollectiveKind.ALL_GATHER,
                allocates=op.out_bytes if owner_of.get(op.name) is key else -1,
                reads=tuple(owner_of[name] for name in op.inputs if name in owner_of),
                waited=waited if waited is not None and ops[waited].kind is OpKind.COLLECTIVE else None,
                scratch=op.scratch_bytes,
            )

    def run(self, order: list) -> Timeline:
        """`order` run whole."""
        run = Timeline(self.facts, len(order), len(self.streams))
        for i, key in enumerate(order):
            run.step(i, key)
        return run

    def measure(self, order: list) -> tuple[int, float, tuple[int, int, int]]:
        """(peak bytes, exposed seconds, (bytes, collectives, all-gathers) most in flight) of `order`."""
        run = self.run(order)
        _, peaks = run.live_bytes(order, 0, 0, run.freed(run.uses))
        return max(peaks, default=0), seconds(run.exposed), run.worst
