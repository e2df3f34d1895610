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
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node

from .cost_model import CostModel, op_facts
from .nodes import PASS_META, is_all_to_all, is_collective, is_wait_tensor, mutates_an_input, wait_of
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


def _hoist_under(collective: Node, cost_model: CostModel) -> list[tuple[Node, Node]]:
    """Move the work after `collective`'s wait that does not read it to before the wait, until it
    covers the collective's time; returns each moved node with the node it was before, in order."""
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
            moved.append((node, following))
            covered_s += cost_model.seconds(op_facts(node))
        else:
            break  # a mutation: nothing after it may pass it
        node = following
    return moved


def overlap_all_to_alls(gm: GraphModule, cost_model: CostModel) -> GraphModule:
    """See the module docstring."""
    collectives = [n for n in gm.graph.nodes if is_all_to_all(n)]
    if not collectives:
        return gm
    before_s = simulate(gm, cost_model).total_s
    hoisted = [move for collective in collectives for move in _hoist_under(collective, cost_model)]
    if hoisted and simulate(gm, cost_model).total_s > before_s:
        for node, following in reversed(hoisted):  # back where each was, the last moved first
            following.prepend(node)
        hoisted = []
    for node, _ in hoisted:
        node.meta[PASS_META] = PASS_NAME
    moved = len(hoisted)
    if moved:
        logger.debug("fsdp_graph::%s %d nodes moved under %d all-to-alls", PASS_NAME, moved, len(collectives))
    return gm
