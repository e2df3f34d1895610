"""Work that does not read an all-to-all's tokens moved between the all-to-all and its wait.

A traced all-to-all (expert parallelism's token dispatch and combine, `funcol.all_to_all_single`)
comes with its wait right after it: Dynamo waits on a functional collective's result at once. The
work after it that does not read the received tokens, a shared expert above all (torchtitan's MoE
computes it after the routed experts' combine), could run while they travel. This pass moves such
work up, in its order, to between the all-to-all and its wait, until its compute time (cost model)
covers the all-to-all's time:

    before:  A2A  wait  y(1)  x(1)  y(2)  x(2) ..      x: reads nothing the wait gave, y: does
    after:   A2A  x(1)  x(2) ..  wait  y(1)  y(2) ..

The walk stops at another collective or wait (each stream keeps its order, and no FSDP collective
changes place), at an op that mutates its input, and at the graph's output. The moves are kept only
where the simulated step (passes/simulator.py) is no slower after them, all of a graph's or none:
work moved up may have hidden an FSDP prefetch issued after a wait. That takes two simulations per
graph; one per all-to-all would make the pass quadratic in depth. Only the order changes: every node
keeps its inputs before it (an x reads only nodes before the wait or x's before it), and every
collective is issued where it was, so each process group's order on the wire is the traced one.
Moved nodes carry `PASS_META = "overlap_all_to_alls"`.

Chunks. A MoE layer run on slices of its tokens (`fsdp_graph.api.run_in_chunks`) has each slice's
all-to-alls in a row, in program order: slice 0's dispatch, its experts, its combine, then slice 1's.
The experts of a slice read its dispatch's tokens, so nothing of the slice itself can hide them; the
other slice's work can. Before the walk above, each slice's j-th all-to-all moves up, with the work it
needs that comes after the other slice's j-th, to just after that one, so they go on the wire in
pairs (graph_trainer's EP schedule):

    before:  D0  E0  C0 | D1  E1  C1        D: dispatch, E: experts, C: combine, of slice 0 or 1
    after:   D0  D1  E0  C0  E1  C1         E0 runs while D1 travels, E1 while C0 does

The j-th are counted per side of the graph (a backward's gradients, and the forward it recomputes
under checkpointing), and the slice that issues its j-th first leads: in backward autograd has slice
1 first. An all-to-all stays where it is when the work it needs holds a collective (a wait on an
all-to-all aside) or a mutation, or would pass a write to what it reads, or when the slices differ in
their numbers of all-to-alls on that side. This moves all-to-alls past each other, which the walk
above never does: every rank runs this pass on the same graph, so each process group still sees one
order on every rank; but a rank whose call falls back alone to the eager hooks issues them in program
order (the limit in docs/composition.md, "A MoE layer on slices of its tokens").
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node

from .cost_model import CostModel, op_facts
from .nodes import PASS_META, chunk_of, collective_of, is_all_to_all, is_collective, is_wait_tensor, mutates_an_input, wait_of
from .simulator import simulate

logger = logging.getLogger(__name__)

PASS_NAME = "overlap_all_to_alls"


def _movable(node: Node) -> bool:
    """Whether `node` may run earlier than it does: a pure op (or an item of one's result)."""
    if node.op != "call_function" or is_collective(node) or is_wait_tensor(node):
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, torch._ops.OpOverload) and not mutates_an_input(node)


def _hoist_under(collective: Node, cost_model: CostModel) -> list[Node]:
    """Move the work after `collective`'s wait that does not read it to before the wait, until it
    covers the collective's time; returns the nodes moved."""
    wait = wait_of(collective)
    if wait is None:
        return []
    budget_s, covered_s = cost_model.seconds(op_facts(collective)), 0.0
    reads_wait = {wait}
    moved, node = [], wait.next
    while covered_s < budget_s and node.op != "output":
        following = node.next
        if is_collective(node) or is_wait_tensor(node):
            break
        if any(arg in reads_wait for arg in node.all_input_nodes):
            reads_wait.add(node)
        elif _movable(node):
            wait.prepend(node)
            moved.append(node)
            covered_s += cost_model.seconds(op_facts(node))
        else:
            break  # a mutation: nothing after it may pass it
        node = following
    return moved


def _slices_by_side(collectives: list[Node]) -> dict[object, dict[int, list[Node]]]:
    """The all-to-alls of `run_in_chunks` slices, per side of the graph and per slice, in graph
    order. The side: forward or backward work in a joint graph's partition (a checkpointed forward
    recomputed in the backward is forward work there), None in a graph that was never joint."""
    found: dict[object, dict[int, list[Node]]] = {}
    for node in collectives:
        if chunk_of(node) is not None:
            found.setdefault(node.meta.get("partitioner_tag"), {}).setdefault(chunk_of(node), []).append(node)
    return found


def _pull_up_after(anchor: Node, collective: Node) -> list[Node]:
    """Move `collective` and what it needs of the nodes between `anchor` and it to just after
    `anchor`, in their order; returns the nodes moved, none when what it needs holds a collective
    (a wait on an all-to-all aside) or another op that may not move, or would pass an op that
    writes a tensor it reads (as an argument: graphs here are functional but for such writes)."""
    between, node = [], anchor.next
    while node is not collective:
        if node.op == "output":
            return []  # `collective` before `anchor`: nothing to do
        between.append(node)
        node = node.next
    needed = {collective}
    for node in reversed(between):
        if any(user in needed for user in node.users):
            if not (_movable(node) or _is_symbolic(node) or _waits_on_an_all_to_all(node)):
                return []  # a collective, or a wait on one not an all-to-all, or a mutation
            needed.add(node)
    read = {arg for n in needed for arg in n.all_input_nodes}
    for node in between:  # what is needed may not pass a write to what it reads
        if mutates_an_input(node) and (node in read or not read.isdisjoint(node.all_input_nodes)):
            return []
    moved = [*(n for n in between if n in needed), collective]
    place = anchor
    for node in moved:
        place.append(node)
        place = node
    return moved


def _waits_on_an_all_to_all(node: Node) -> bool:
    """A `wait_tensor` of an all-to-all, or of such a wait (AOTAutograd may wait twice)."""
    while is_wait_tensor(node) and collective_of(node) is None and isinstance(node.args[0], Node):
        node = node.args[0]
    collective = collective_of(node)
    return collective is not None and is_all_to_all(collective)


def _is_symbolic(node: Node) -> bool:
    """Arithmetic on sizes (a SymInt from a count read off the data, as the dispatch's splits are):
    `operator.add`, `torch.sym_sum` and the like, whose value is a number."""
    return (node.op == "call_function" and not isinstance(node.target, torch._ops.OpOverload)
            and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)))


def _pair_slices(collectives: list[Node]) -> list[Node]:
    """The j-th all-to-all of each slice pulled up to just after the j-th of the slice that issues
    it before (module docstring, Chunks); returns the nodes moved. `collectives`: the graph's
    all-to-alls in graph order. The j-th of every slice are the same all-to-all of the same layer,
    where the slices have as many on that side of the graph."""
    position = {n: i for i, n in enumerate(collectives)}
    moved: list[Node] = []
    for slices in _slices_by_side(collectives).values():
        if len(slices) < 2 or len({len(found) for found in slices.values()}) != 1:
            continue
        for same in zip(*slices.values()):
            same = sorted(same, key=position.__getitem__)
            for earlier, later in zip(same, same[1:]):
                moved.extend(_pull_up_after(earlier, later))
    return moved


def overlap_all_to_alls(gm: GraphModule, cost_model: CostModel) -> GraphModule:
    """See the module docstring."""
    collectives = [n for n in gm.graph.nodes if is_all_to_all(n)]
    if not collectives:
        return gm
    before_s = simulate(gm, cost_model).total_s
    order = list(gm.graph.nodes)
    paired = _pair_slices(collectives)
    hoisted = [node for collective in collectives for node in _hoist_under(collective, cost_model)]
    moved = paired + hoisted
    if moved and simulate(gm, cost_model).total_s > before_s:
        for earlier, node in zip(order, order[1:]):  # every node back in its place
            earlier.append(node)
        moved = []
    for node in moved:
        node.meta[PASS_META] = PASS_NAME
    if moved:
        logger.debug("fsdp_graph::%s %d nodes moved (%d to pair slices) under %d all-to-alls",
                     PASS_NAME, len(moved), len(paired), len(collectives))
    return gm
