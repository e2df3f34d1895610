"""Predict one graph's run on a machine: compute and communication timelines, exposed communication,
peak memory.

A graph is first reduced to a `Program`: its nodes in order, each with machine-independent facts
(passes/cost_model.py) and what it reads. Programs are plain data, written to dumps as JSON, so the
inspector can replay a CPU run's schedule on a GPU profile.

[Note: Simulator model]
- One compute stream runs compute nodes in graph order, back to back. Views, waits and
  placeholders take no time.
- One communication stream per parallelism (FSDP's; tensor parallelism's, whose process group NCCL
  runs on a stream of its own) runs its collectives in issue order: a collective starts when it is
  issued (the compute clock at its position) and the previous collective of its stream has finished.
- A `wait_tensor` stalls the compute stream until its collective has finished; the stall is
  *exposed communication*. The step ends when every stream is idle.
- Memory counts bytes the step allocates: what the graph allocates, and in a backward the
  activations its forward saved for it (`saved_inputs`; a saved view counts its whole storage,
  once), which the step made and the backward frees as it goes; other inputs (parameters, the
  batch, incoming gradients) are the caller's. So a backward's peak is what the step holds at that
  point above its start, the figure a memory budget is about. A non-view node allocates its output
  at its position; views (per the op schema) and `getitem`s share their input's storage; a storage
  dies after the last node that reads it or any view of it, or lives to the end if the graph
  returns it. A collective reads its input until its wait, its output exists from its issue, and
  its scratch (`Op.scratch_bytes`) from its issue to its wait. A compile region's call holds its
  body's own peak while it runs (its scratch, given back at once); then each output it hands back
  is a tensor of its own.
This is the model the scheduling passes optimise against; it ignores contention between the
streams, allocator caching and fragmentation.

[Note: Exact simulated time]
The simulator keeps time as whole ticks of 2**-100 s (`ticks`). A duration from the cost model (a
float of seconds) converts exactly: any float above 2**-48 s is a whole number of ticks. Sums and
maxima of integers are exact, so a clock does not depend on the order in which the same durations
were added, and times are rounded to float seconds once, when reported (`seconds`). The reorder pass
relies on this: it measures a candidate order as the current order's remainder applied to the
candidate's state ([Note: Measuring a move] in passes/measured_order.py), the same number a whole
simulation gives only when the arithmetic is exact.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from .cost_model import CollectiveKind, CostModel, OpFacts, is_view, op_facts
from .nodes import (REGION_OUTPUT_META, backend_of, collective_label, is_collective, is_region_call, is_tangent_name,
                    is_wait_tensor, region_body, size_hint, value_bytes)


class OpKind(Enum):
    INPUT = "input"
    COMPUTE = "compute"
    VIEW = "view"
    COLLECTIVE = "collective"
    WAIT = "wait"
    OUTPUT = "output"


@dataclass
class Op:
    """One node of a `Program`. Attributes:
    name: the FX node's name.
    kind: an `OpKind`.
    target: the op, short (`aten.mm`), for display.
    inputs: names of the nodes it reads, in order.
    out_bytes: bytes of its output (0 for the output node).
    facts: what it does (flops, bytes, collective) -- see `OpFacts`.
    group: the fsdp_graph group of a collective, e.g. "layers.3".
    scratch_bytes: what a collective holds besides its output from its issue to its wait (gloo's
        copies; `_gloo_scratch_bytes`); what a compile region's call holds while it runs (its body's
        peak, outputs included; `_region_scratch_bytes`).
    storage_of: the node whose storage its output is, so that it allocates nothing of its own: an
        `out=` argument (gloo's all-gathers after passes/gloo.py), or for a backward's saved input an
        earlier saved input viewing the same tensor (`_size_saved_storages`). Its own name on a
        `getitem` of a compile region's call, which is a tensor of its own (`_region_output`).
    """

    name: str
    kind: OpKind
    target: str
    inputs: list[str]
    out_bytes: int = 0
    facts: OpFacts = field(default_factory=OpFacts)
    group: Optional[str] = None
    scratch_bytes: int = 0
    storage_of: Optional[str] = None

    def to_json(self) -> dict:
        return {"name": self.name, "kind": self.kind.value, "target": self.target, "inputs": self.inputs,
                "out_bytes": self.out_bytes, "facts": _facts_to_json(self.facts), "group": self.group,
                "scratch_bytes": self.scratch_bytes, "storage_of": self.storage_of}

    @classmethod
    def from_json(cls, data: dict) -> "Op":
        return cls(data["name"], OpKind(data["kind"]), data["target"], list(data["inputs"]), data["out_bytes"],
                   _facts_from_json(data["facts"]), data.get("group"), data.get("scratch_bytes", 0), data.get("storage_of"))


def _facts_to_json(facts: OpFacts) -> dict:
    data = {f.name: getattr(facts, f.name) for f in fields(facts)}
    data["collective"] = facts.collective.value if facts.collective else None
    data["parts"] = [_facts_to_json(part) for part in facts.parts]
    return data


def _facts_from_json(data: dict) -> OpFacts:
    data = dict(data)
    data["collective"] = CollectiveKind(data["collective"]) if data["collective"] else None
    data["parts"] = tuple(_facts_from_json(part) for part in data.get("parts", ()))
    return OpFacts(**data)


Program = list[Op]

TICKS_PER_S = 1 << 100  # see [Note: Exact simulated time]


def ticks(seconds: float) -> int:
    """`seconds` as whole ticks: exact for any float above 2**-48 s."""
    return round(math.ldexp(seconds, 100))


def seconds(num_ticks: int) -> float:
    """Ticks as float seconds, correctly rounded."""
    return num_ticks / TICKS_PER_S


def _kind(node: Node) -> OpKind:
    if node.op == "placeholder" or node.op == "get_attr":
        return OpKind.INPUT
    if node.op == "output":
        return OpKind.OUTPUT
    if is_collective(node):
        return OpKind.COLLECTIVE
    if is_wait_tensor(node):
        return OpKind.WAIT
    if is_view(node) or node.target is operator.getitem:
        return OpKind.VIEW
    return OpKind.COMPUTE


def _short(node: Node) -> str:
    if node.op != "call_function":
        return node.op
    return str(getattr(node.target, "__name__", node.target)).removesuffix(".default")


def op_of(node: Node) -> Op:
    kind = _kind(node)
    facts = op_facts(node) if kind in (OpKind.COMPUTE, OpKind.COLLECTIVE) else OpFacts()
    out_bytes = 0 if kind is OpKind.OUTPUT or is_region_call(node) else value_bytes(node.meta.get("val"))
    group = collective_label(node) if kind is OpKind.COLLECTIVE else None
    scratch = _gloo_scratch_bytes(node, facts, out_bytes) if kind is OpKind.COLLECTIVE else _region_scratch_bytes(node)
    written = _written_input(node)
    inputs = [a.name for a in node.all_input_nodes]
    storage_of = written.name if written is not None else None
    if _region_output(node):
        inputs += [a.name for a in node.args[0].all_input_nodes]
        storage_of = node.name
    return Op(node.name, kind, _short(node), inputs, out_bytes, facts, group, scratch, storage_of)


def _region_output(node: Node) -> bool:
    """A `getitem` of a compile region's call. A region hands back tensors of their own (its output,
    the values its backward needs, its inputs' gradients), each alive until its own last reader
    (as views of one storage, all lived until the last was read). The call allocates nothing; each
    `getitem` allocates its tensor and reads what the call read, so the call's inputs outlive the
    outputs' allocation as they do the call's."""
    return node.target is operator.getitem and isinstance(node.args[0], Node) and is_region_call(node.args[0])


def _region_scratch_bytes(node: Node) -> int:
    """What a compile region's call allocates while it runs: its body's peak (its outputs among
    it, alive at its end), the same ops inlined would allocate. 0 for any other node."""
    body = region_body(node)
    return memory_profile(program_of(body), callers_inputs=True).peak_bytes if body is not None else 0


def _allocates_apart(op: Op) -> bool:
    return op.kind is OpKind.VIEW and op.storage_of == op.name


def _gloo_scratch_bytes(node: Node, facts: OpFacts, out_bytes: int) -> int:
    """What gloo allocates for collective `node` besides its output (measured with torch alone,
    examples/repro/gloo_collective_scratch.py): an all-gather a copy of its output while it runs; a
    reduce-scatter a copy of its input until its wait, and one of its output while it runs. The model
    keeps both until the wait: it places memory by position, not by when a transfer ends."""
    if facts.collective not in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER) or backend_of(node) != "gloo":
        return 0
    if facts.collective is CollectiveKind.ALL_GATHER:
        return out_bytes
    return value_bytes(node.args[0].meta.get("val")) + out_bytes


def _storage_bytes(val) -> int:
    """Bytes of the storage under tensor `val`: more than its own where it is a view (a saved query
    slicing a fused query-key-value projection keeps the whole projection alive). 0 if unknown."""
    try:
        return size_hint(val.untyped_storage().nbytes()) if isinstance(val, torch.Tensor) else 0
    except (TypeError, RuntimeError, NotImplementedError):  # tensor subclasses
        return 0


# [Note: Region outputs' fake storages]
# Two calls of one compile region in a training graph get the very same fake tensors as outputs, so
# the fake values of a saved activation of block 2 and of block 3 share a storage where the real
# ones do not (torch alone: examples/repro/region_fake_outputs_share_storage.py).
# Read as aliases, the two would count as one tensor, kept until the later one's last use, and a
# backward's saved activations would be under-counted by all but one block's. A region's output that
# is not one of its inputs is a tensor of its own (torch refuses outputs that alias an input or each
# other), so the model does not read its storage: its own bytes, its own lifetime.


def _size_saved_storages(gm: GraphModule, program: Program) -> None:
    """Each saved input of a backward counts the storage it views (`_storage_bytes`), and one that
    views the same storage as an earlier one is that one's (`Op.storage_of`): counted once, alive
    until its last use by either. The graph's metadata keeps the forward's storages (fake tensors
    alias as the real ones will), except for a compile region's outputs ([Note: Region outputs'
    fake storages])."""
    first: dict[StorageWeakRef, str] = {}
    saved = saved_inputs(program)
    ops = {op.name: op for op in program}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        nbytes = _storage_bytes(val) if node.name in saved and not node.meta.get(REGION_OUTPUT_META) else 0
        if not nbytes:
            continue
        op = ops[node.name]
        op.out_bytes = max(op.out_bytes, nbytes)
        key = StorageWeakRef(val.untyped_storage())
        if key in first:
            op.storage_of = first[key]
        else:
            first[key] = node.name


def _written_input(node: Node) -> Optional[Node]:
    """The argument whose storage `node`'s output is, per the op schema (`Tensor(a!) out` returned as
    `Tensor(a!)`), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    returns = node.target._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None or not returns[0].alias_info.is_write:
        return None
    alias_set = returns[0].alias_info.before_set
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or arg.alias_info.before_set != alias_set:
            continue
        value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
        return value if isinstance(value, Node) else None
    return None


def saved_inputs(program: Program) -> frozenset[str]:
    """The inputs of a backward program (one with incoming gradients, `tangents_*`) that its forward
    saved for it: activations, recomputation's inputs. Parameters (`primals_*`, resident anyway) and
    the incoming gradients are not; a forward has none."""
    inputs = [op.name for op in program if op.kind is OpKind.INPUT]
    if not any(is_tangent_name(name) for name in inputs):
        return frozenset()
    return frozenset(name for name in inputs if not (name.startswith("primals") or is_tangent_name(name)))


def program_of(gm: GraphModule) -> Program:
    """`gm`'s nodes in graph order as a `Program`."""
    program = [op_of(node) for node in gm.graph.nodes]
    _size_saved_storages(gm, program)
    return program


# -- memory ------------------------------------------------------------------------------------------


@dataclass
class MemoryProfile:
    """Attributes: peak_bytes (graph-allocated, inputs excluded), peak_at (the node allocating at the
    peak), live_bytes (after each op, in program order)."""

    peak_bytes: int
    peak_at: Optional[str]
    live_bytes: list[int]


def memory_profile(program: Program, callers_inputs: bool = False) -> MemoryProfile:
    """Live bytes by liveness over program order. See [Note: Simulator model]. Inputs are not counted,
    except a backward's `saved_inputs`: live from the start until their last use. `callers_inputs`:
    every input is the caller's, saved ones too (a compile region's body, whose caller holds them)."""
    owned_inputs = frozenset() if callers_inputs else saved_inputs(program)
    storage: dict[str, Optional[str]] = {}  # node -> the node that allocated its storage (None: an input)
    wait_of: dict[str, int] = {}  # collective -> position of its wait
    for i, op in enumerate(program):
        if op.kind is OpKind.INPUT:  # the step's storage if it is a saved input, else the caller's
            storage[op.name] = (storage[op.storage_of] if op.storage_of else op.name) if op.name in owned_inputs else None
        elif _allocates_apart(op):
            storage[op.name] = op.name
        elif op.kind in (OpKind.VIEW, OpKind.WAIT):
            storage[op.name] = storage.get(op.inputs[0]) if op.inputs else None
            if op.kind is OpKind.WAIT and op.inputs:
                wait_of[op.inputs[0]] = i
        elif op.storage_of is not None:
            storage[op.name] = storage.get(op.storage_of)
        elif op.kind is not OpKind.OUTPUT:
            storage[op.name] = op.name
    last = len(program)
    last_use: dict[str, int] = {}
    for i, op in enumerate(program):
        owner = storage.get(op.name)
        if owner is not None:
            last_use.setdefault(owner, i)
        until = last if op.kind is OpKind.OUTPUT else wait_of.get(op.name, i) if op.kind is OpKind.COLLECTIVE else i
        for name in op.inputs:
            owner = storage.get(name)
            if owner is not None:
                last_use[owner] = max(last_use.get(owner, 0), until, i)
    dies_at: dict[int, list[str]] = {}
    for owner, i in last_use.items():
        dies_at.setdefault(i, []).append(owner)
    sizes = {op.name: op.out_bytes for op in program}
    scratch_until: dict[int, int] = {}  # position -> scratch bytes freed there (a collective's wait)
    live, peak, peak_at, curve = 0, 0, None, []
    for i, op in enumerate(program):
        allocated = sizes[op.name] if storage.get(op.name) == op.name else 0
        if op.scratch_bytes:
            allocated += op.scratch_bytes
            at = wait_of.get(op.name, last) if op.kind is OpKind.COLLECTIVE else i
            scratch_until[at] = scratch_until.get(at, 0) + op.scratch_bytes
        if allocated:
            live += allocated
            if live > peak:
                peak, peak_at = live, op.name
        for owner in dies_at.get(i, ()):
            live -= sizes[owner]
        live -= scratch_until.pop(i, 0)
        curve.append(live)
    return MemoryProfile(peak, peak_at, curve)


# -- time ----------------------------------------------------------------------------------------------


@dataclass
class CollectiveSpan:
    """One collective on its communication stream. Attributes: name, kind, group, num_bytes,
    issue_index / wait_index (positions in the program), prefetch_distance (compute nodes between
    issue and wait: what can hide it), issue_s / start_s / end_s, exposed_s (the stall at its wait),
    busy_s (its time on the stream: end_s - start_s, rounded once, so that a wholly exposed collective
    has busy_s == exposed_s)."""

    name: str
    kind: str
    group: Optional[str]
    num_bytes: int
    issue_index: int
    wait_index: int
    prefetch_distance: int
    issue_s: float
    start_s: float
    end_s: float
    exposed_s: float = 0.0
    parallelism: str = "fsdp"  # its stream: see [Note: Simulator model]
    busy_s: float = 0.0


@dataclass
class Simulation:
    """Attributes: total_s (step time), compute_s, comm_s (busy time of each stream), exposed_comm_s
    (compute-stream stalls at waits), compute_spans ([name, start_s, end_s] of compute nodes),
    collectives (`CollectiveSpan`s in issue order), memory (`MemoryProfile`), profile (its name),
    memory_points ([compute clock, live bytes] after each node)."""

    total_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    compute_spans: list[tuple[str, float, float]]
    collectives: list[CollectiveSpan]
    memory: MemoryProfile
    profile: str
    memory_points: list[tuple[float, int]] = field(default_factory=list)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_comm_s / self.total_s if self.total_s else 0.0


def simulate(program: "Program | GraphModule", cost_model: CostModel) -> Simulation:
    """Run `program` on `cost_model`'s machine. See [Note: Simulator model]."""
    if isinstance(program, GraphModule):
        program = program_of(program)
    clock = compute = comm = exposed = 0  # ticks: [Note: Exact simulated time]
    comm_free: dict[str, int] = {}  # per stream (parallelism): when its last collective ends
    spans: list[tuple[str, int, int]] = []
    by_name: dict[str, CollectiveSpan] = {}
    ends: dict[str, int] = {}  # collective -> when it ends
    collectives: list[CollectiveSpan] = []
    num_compute = 0
    compute_seen: dict[str, int] = {}
    clocks: list[int] = []
    for i, op in enumerate(program):
        if op.kind is OpKind.COMPUTE:
            duration = ticks(cost_model.seconds(op.facts))
            spans.append((op.name, clock, clock + duration))
            clock += duration
            compute += duration
            num_compute += 1
        elif op.kind is OpKind.COLLECTIVE:
            duration = ticks(cost_model.seconds(op.facts))
            start = max(clock, comm_free.get(op.facts.parallelism, 0))
            end = ends[op.name] = comm_free[op.facts.parallelism] = start + duration
            comm += duration
            span = CollectiveSpan(op.name, op.facts.collective.value, op.group, op.facts.collective_bytes,
                                  i, -1, 0, seconds(clock), seconds(start), seconds(end),
                                  parallelism=op.facts.parallelism, busy_s=seconds(duration))
            by_name[op.name] = span
            compute_seen[op.name] = num_compute
            collectives.append(span)
        elif op.kind is OpKind.WAIT and op.inputs and op.inputs[0] in by_name:
            span = by_name[op.inputs[0]]
            span.wait_index = i
            span.prefetch_distance = num_compute - compute_seen[span.name]
            end = ends[span.name]
            if end > clock:
                span.exposed_s = seconds(end - clock)
                exposed += end - clock
                clock = end
        clocks.append(clock)
    total = max([clock, *comm_free.values()])
    memory = memory_profile(program)
    points = [(seconds(c), live) for c, live in zip(clocks, memory.live_bytes)]
    spans_s = [(name, seconds(start), seconds(end)) for name, start, end in spans]
    return Simulation(seconds(total), seconds(compute), seconds(comm), seconds(exposed), spans_s, collectives, memory,
                      cost_model.profile.name, points)


def in_flight(program: Program) -> tuple[int, int]:
    """The most collective bytes, and the most collectives, issued and not yet waited on at any
    point of `program`."""
    pending: dict[str, int] = {}
    worst_bytes = worst_count = 0
    for op in program:
        if op.kind is OpKind.COLLECTIVE:
            pending[op.name] = op.facts.collective_bytes
            worst_bytes = max(worst_bytes, sum(pending.values()))
            worst_count = max(worst_count, len(pending))
        elif op.kind is OpKind.WAIT and op.inputs:
            pending.pop(op.inputs[0], None)
    return worst_bytes, worst_count


def all_gathers_in_flight(program: Program) -> int:
    """The most all-gathers issued and not yet waited on at any point of `program`."""
    pending: set[str] = set()
    worst = 0
    for op in program:
        if op.kind is OpKind.COLLECTIVE and op.facts.collective is CollectiveKind.ALL_GATHER:
            pending.add(op.name)
            worst = max(worst, len(pending))
        elif op.kind is OpKind.WAIT and op.inputs:
            pending.discard(op.inputs[0])
    return worst


def in_flight_bytes(program: Program) -> int:
    """The most collective bytes issued and not yet waited on at any point of `program`."""
    return in_flight(program)[0]


# -- one graph, many orders ------------------------------------------------------------------------------


class OrderCost:
    """What the scheduler compares between candidate orders of one graph's nodes, computed fast: the
    numbers `simulate` (exposed communication, peak memory), `in_flight` and `all_gathers_in_flight`
    give for the same program, bit for bit.

    [Note: Measuring candidate orders]
    The reorder pass measures one candidate order per move it tries, and the moves grow with the
    number of blocks, as does the program: a full `simulate` per candidate made the pass quadratic in
    depth. Everything that does not depend on the order is found
    once here: each node's duration, its stream, which storage it allocates and which storages it
    reads (a view reads its base's; see [Note: Simulator model]). A whole order then costs one pass
    over its nodes for the clocks and the collectives in flight and one sweep for live memory, with
    `simulate`'s exact arithmetic ([Note: Exact simulated time]), so the decisions are the ones whole
    simulations would make. The scheduler measures a move from the order it has measured, over the
    positions the move changes: [Note: Measuring a move] in passes/measured_order.py.
    tests/test_passes_schedule.py checks every order the scheduler measures against `simulate`.

    Assumes the orders are topological (every node after its inputs), as the scheduler's are.
    """

    def __init__(self, ops: dict, cost_model: CostModel) -> None:
        """`ops`: every node of the graph (keys, any hashable, in a topological order) with its `Op`."""
        owner_of: dict[str, object] = {}  # op name -> the key whose storage it is (absent: an input's or none)
        key_of = {op.name: key for key, op in ops.items()}
        owned = saved_inputs(list(ops.values()))
        self._facts: dict[object, tuple] = {}
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
        for key, op in ops.items():
            reads = tuple(owner_of[name] for name in op.inputs if name in owner_of)
            duration = ticks(cost_model.seconds(op.facts)) if op.kind in (OpKind.COMPUTE, OpKind.COLLECTIVE) else 0
            allocates = op.out_bytes if owner_of.get(op.name) is key else -1
            waited = key_of.get(op.inputs[0]) if op.kind is OpKind.WAIT and op.inputs else None
            is_all_gather = op.facts.collective is CollectiveKind.ALL_GATHER
            self._facts[key] = (op.kind, duration, op.facts.parallelism, op.facts.collective_bytes, is_all_gather,
                                allocates, reads, waited, op.scratch_bytes)

    def measure(self, order: list) -> tuple[int, float, tuple[int, int, int]]:
        """(peak bytes, exposed seconds, (bytes, collectives, all-gathers) most in flight) of `order`."""
        compute, collective, wait, output = OpKind.COMPUTE, OpKind.COLLECTIVE, OpKind.WAIT, OpKind.OUTPUT
        facts = self._facts
        clock = exposed = 0  # ticks: [Note: Exact simulated time]
        stream_free: dict[str, int] = {}
        ends: dict[object, int] = {}  # issued collective -> when it finishes
        pending: dict[object, int] = {}  # collective in flight -> its bytes
        pending_bytes = worst_bytes = worst_count = 0
        gathers: set = set()
        worst_gathers = 0
        last_use: dict[object, int] = {}  # storage -> position of its last reader
        reads_until_wait: dict[object, tuple] = {}  # collective -> the storages it reads until its wait
        pending_scratch: dict[object, int] = {}  # collective in flight -> its scratch bytes
        end = len(order)  # what the output reads lives past the last position
        scratch_at: dict[int, int] = {}  # position -> scratch bytes taken (+, a collective or region) or given back (-, its wait)
        for i, key in enumerate(order):
            kind, duration, stream, num_bytes, is_all_gather, allocates, reads, waited, scratch = facts[key]
            if scratch:
                scratch_at[i] = scratch
            if allocates >= 0:
                last_use.setdefault(key, i)
            if kind is compute:
                clock += duration
            elif kind is collective:
                start = max(clock, stream_free.get(stream, 0))
                ends[key] = stream_free[stream] = start + duration
                if key in pending:
                    pending_bytes -= pending[key]
                pending[key] = num_bytes
                pending_bytes += num_bytes
                worst_bytes = max(worst_bytes, pending_bytes)
                worst_count = max(worst_count, len(pending))
                if is_all_gather:
                    gathers.add(key)
                    worst_gathers = max(worst_gathers, len(gathers))
                reads_until_wait[key] = reads
                if scratch:
                    pending_scratch[key] = scratch
            elif kind is wait:
                if waited in ends:
                    finish = ends[waited]
                    if finish > clock:
                        exposed += finish - clock
                        clock = finish
                if waited in pending:
                    pending_bytes -= pending.pop(waited)
                gathers.discard(waited)
                if waited in pending_scratch:
                    scratch_at[i] = scratch_at.get(i, 0) - pending_scratch.pop(waited)
                for owner in reads_until_wait.get(waited, ()):
                    if last_use[owner] < i:
                        last_use[owner] = i
            until = end if kind is output else i
            for owner in reads:
                if last_use.get(owner, 0) < until:
                    last_use[owner] = until
        freed: dict[int, int] = {}  # position -> bytes whose last reader it is
        for owner, i in last_use.items():
            freed[i] = freed.get(i, 0) + facts[owner][5]
        live = peak = 0
        for i, key in enumerate(order):
            allocates = max(facts[key][5], 0) + max(scratch_at.get(i, 0), 0)
            if allocates:
                live += allocates
                if live > peak:
                    peak = live
            live -= freed.get(i, 0) - min(scratch_at.get(i, 0), 0)
            if facts[key][0] is compute:  # a compile region's body, held while it runs
                live -= facts[key][8]
        return peak, seconds(exposed), (worst_bytes, worst_count, worst_gathers)
