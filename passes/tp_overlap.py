"""Independent computation moved under tensor parallelism's all-reduces.

After `async_tp`, a chunked all-reduce hides behind the matmul chunks that follow it, but the last
chunk, and an all-reduce longer than its matmul (attention's output projection in the 70B
prediction of examples/benchmark_tp.py), still stall the compute stream at their wait, in forward, in the
recompute of activation checkpointing and in backward. In backward there is computation that does
not need them: the recompute of block i depends only on block i's saved input and parameters, not
on the gradients of block i+1 computed just before it. This pass moves such computation from before
an all-reduce group to after it, so it runs while the all-reduces are on the wire:

    before:  x(1) .. x(k)  producers(AR)  AR(0) .. AR(n-1)  wait(0..n-1)
    after:   producers(AR)  AR(0) .. AR(n-1)  x(1) .. x(k)  wait(0..n-1)

where x(1..k) are the nodes nearest before the group that are not its ancestors, taken until their
compute time reaches the group's all-reduce time (cost model). Equivalently, the group and its
producers are issued earlier. Groups are handled last first, so that a group's moved nodes are not
taken again by the group after it.

Assumes: forward or backward graphs after `async_tp` and `reorder_for_overlap`. Guarantees: only
the order changes; every node keeps its inputs before it (x(j) are not ancestors of the group, so no
producer of it moves below it). The walk back stops at a collective the group depends on, at a wait
the group depends on unless it is an FSDP all-gather's that the computation left between the
all-gather and its wait still covers, at another tp collective's issue (moving it later would
reorder the tp stream), at placeholders and at ops that mutate an input. An FSDP all-gather or
reduce-scatter the group does not need may move below it (issued later, on its own stream) where the
computation from the group to its wait still covers it. Moved nodes carry `PASS_META =
"overlap_tp_all_reduces"`.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch.fx import GraphModule, Node

from .async_tp import is_tp_all_reduce
from .cost_model import CostModel, op_facts
from .nodes import (
    ASYNC_TP_META, PASS_META, collective_of, is_all_gather, is_collective, is_fsdp_collective, is_wait_tensor,
    mutates_an_input, wait_of,
)

logger = logging.getLogger(__name__)

PASS_NAME = "overlap_tp_all_reduces"


def _groups(gm: GraphModule) -> list[list[Node]]:
    """TP all-reduces in graph order, the chunks of one decomposed all-reduce as one group."""
    groups: list[list[Node]] = []
    for node in gm.graph.nodes:
        if not is_tp_all_reduce(node):
            continue
        chunk = node.meta.get(ASYNC_TP_META)
        if chunk is not None and chunk[0] > 0 and groups and groups[-1][-1].meta.get(ASYNC_TP_META, (0, 0))[0] == chunk[0] - 1:
            groups[-1].append(node)
        else:
            groups.append([node])
    return groups


def _still_hidden(collective: Node, anchor: Node, cost_model: CostModel) -> bool:
    """Would `collective`, issued right after `anchor`, still end before its wait (compute only)?"""
    wait, budget_s = wait_of(collective), cost_model.seconds(op_facts(collective))
    node, compute_s = anchor.next, 0.0
    while wait is not None and node is not wait and node.op != "output" and compute_s < budget_s:
        facts = op_facts(node)
        compute_s += cost_model.seconds(facts) if facts.collective is None else 0.0
        node = node.next
    return compute_s >= budget_s


def _movable(node: Node, anchor: Node, cost_model: CostModel) -> bool:
    """May `node` run after `anchor`, if nothing it feeds comes before it?"""
    if node.op != "call_function" or mutates_an_input(node):
        return False
    if is_collective(node):
        # An FSDP all-gather or reduce-scatter may issue later, on its own stream, while it would
        # still end before its wait; another tp collective may not overtake (one tp stream).
        return is_fsdp_collective(node) and _still_hidden(node, anchor, cost_model)
    return isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) or node.target is operator.getitem


def _compute_s(start: Node, end: Node, cost_model: CostModel) -> float:
    """Compute time of the nodes strictly between `start` and `end`."""
    total, node = 0.0, start.next
    while node is not end and node.op != "output":
        facts = op_facts(node)
        total += cost_model.seconds(facts) if facts.collective is None else 0.0
        node = node.next
    return total


def _overlap(group: list[Node], cost_model: CostModel) -> int:
    """Move the nodes before `group` that it does not need below its last all-reduce; returns how many."""
    target_s = sum(cost_model.seconds(op_facts(n)) for n in group)
    first, anchor = group[0], group[-1]
    cone: set[Node] = set(group)
    needed: set[Node] = {a for n in group for a in n.all_input_nodes}
    moved: list[Node] = []  # latest first
    # All-gathers the group waits for, with the compute that may still leave from under them: [issue, slack_s].
    gathers: list[list] = []
    hidden_s, before_first = 0.0, False
    node = anchor.prev
    while node.op != "root":
        if node is first:
            before_first = True
        if node in cone:
            pass
        elif node in needed:
            if node.op == "placeholder" or is_collective(node) or mutates_an_input(node):
                break
            if is_wait_tensor(node):
                gather = collective_of(node)
                if not is_all_gather(gather):
                    break
                slack_s = _compute_s(gather, node, cost_model) - cost_model.seconds(op_facts(gather))
                if slack_s <= 0:
                    break
                gathers.append([gather, slack_s])
            cone.add(node)
            needed.update(node.all_input_nodes)
        else:
            if before_first and hidden_s >= target_s:
                break
            if not _movable(node, anchor, cost_model) or (is_wait_tensor(node) and collective_of(node) in needed):
                break
            facts = op_facts(node)
            seconds = cost_model.seconds(facts) if facts.collective is None else 0.0
            if any(slack_s < seconds for _, slack_s in gathers):  # it would leave an all-gather exposed
                break
            for entry in gathers:
                entry[1] -= seconds
            moved.append(node)
            hidden_s += seconds
        node = node.prev
        gathers = [entry for entry in gathers if entry[0] is not node]  # walked past its issue
    for node in moved:
        anchor.append(node)
        node.meta[PASS_META] = PASS_NAME
    return len(moved)


def overlap_tp_all_reduces(gm: GraphModule, cost_model: CostModel) -> GraphModule:
    """See the module docstring."""
    groups = _groups(gm)
    if not groups:
        return gm
    num_moved = sum(_overlap(group, cost_model) for group in reversed(groups))
    logger.debug("fsdp_graph::overlap_tp_all_reduces %d nodes moved under %d tp all-reduce groups", num_moved, len(groups))
    return gm
