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

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from .cost_model import CollectiveKind, CostModel, OpFacts, is_view, op_facts
from .nodes import (REGION_OUTPUT_META, backend_of, collective_label, is_collective, is_region_call, is_wait_tensor,
                    region_body, size_hint, value_bytes)
from .program import TICKS_PER_S, Op, OpKind, Program, saved_inputs, seconds, ticks  # noqa: F401 (imported from here)
from .timeline import NodeFacts, OrderCost, Timeline  # noqa: F401 (imported from here)


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
    cost = OrderCost({op.name: op for op in program}, None, callers_inputs)
    names = [op.name for op in program]
    return _memory_of(names, cost.run(names))


def _memory_of(names: list[str], run: Timeline) -> MemoryProfile:
    """The `MemoryProfile` of `run`, a whole run of the program whose nodes are `names`."""
    lives, peaks = run.live_bytes(names, 0, 0, run.freed(run.uses))
    peak = max(peaks, default=0)
    return MemoryProfile(peak, names[peaks.index(peak)] if peak > 0 else None, lives)


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
    cost = OrderCost({op.name: op for op in program}, cost_model)
    run = Timeline(cost.facts, len(program), len(cost.streams))
    compute = comm = 0  # ticks: [Note: Exact simulated time]
    spans: list[tuple[str, float, float]] = []
    by_name: dict[str, CollectiveSpan] = {}
    collectives: list[CollectiveSpan] = []
    num_compute = 0
    compute_seen: dict[str, int] = {}  # collective -> compute nodes before its issue
    clocks: list[int] = []
    for i, op in enumerate(program):
        before = run.clock
        facts = run.step(i, op.name)
        if facts.kind is OpKind.COMPUTE:
            spans.append((op.name, seconds(before), seconds(run.clock)))
            compute += facts.duration
            num_compute += 1
        elif facts.kind is OpKind.COLLECTIVE:
            end = run.in_flight[op.name]
            comm += facts.duration
            span = CollectiveSpan(op.name, op.facts.collective.value, op.group, facts.num_bytes, i, -1, 0,
                                  seconds(before), seconds(end - facts.duration), seconds(end),
                                  parallelism=op.facts.parallelism, busy_s=seconds(facts.duration))
            by_name[op.name] = span
            compute_seen[op.name] = num_compute
            collectives.append(span)
        elif facts.waited is not None:
            span = by_name[facts.waited]
            span.wait_index = i
            span.prefetch_distance = num_compute - compute_seen[span.name]
            if run.clock > before:
                span.exposed_s = seconds(run.clock - before)
        clocks.append(run.clock)
    total = max([run.clock, *run.free])
    memory = _memory_of([op.name for op in program], run)
    points = [(seconds(c), live) for c, live in zip(clocks, memory.live_bytes)]
    return Simulation(seconds(total), seconds(compute), seconds(comm), seconds(run.exposed), spans, collectives,
                      memory, cost_model.profile.name, points)


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
