"""Pin a scheduled graph's order of collectives, waits and compute with `control_deps` edges, so
that Inductor's scheduler keeps what `reorder_for_overlap` (passes/reorder.py) planned."""

from __future__ import annotations

import bisect
import heapq
import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .nodes import collective_of, is_collective, is_wait_tensor
from .simulator import OpKind, _kind


def _last_compute_not_feeding(node: Node, nodes: list[Node], compute: list[int], k: int,
                               index: dict[Node, int]) -> Optional[Node]:
    """The last compute node of `nodes` at positions compute[:k] (before `node`) that `node` does not
    depend on, or None. A node on a path into `node` lies between the two, so the search back from
    `node` goes only as far as the compute node it has reached: usually the one just before (a
    bucket's copy-in), not the whole graph before `node`."""
    seen: set[Node] = set()
    deferred: list[tuple[int, int, Node]] = []  # inputs not searched yet, latest first (a heap)

    def defer(n: Node) -> None:
        heapq.heappush(deferred, (-index.get(n, -1), id(n), n))  # placeholders (-1) are never searched

    for n in node.all_input_nodes:
        defer(n)
    for j in range(k - 1, -1, -1):
        candidate = nodes[compute[j]]
        while deferred and -deferred[0][0] >= compute[j]:
            n = heapq.heappop(deferred)[2]
            if n not in seen:
                seen.add(n)
                for i in n.all_input_nodes:
                    if i not in seen:
                        defer(i)
        if candidate not in seen:
            return candidate
    return None


def _anchor(node: Node) -> Optional[Node]:
    """The node an ordering edge can name for `node`: itself, or for a node of several outputs (a
    compile region's call) the first of its outputs that is a tensor. Inductor lowers a region's
    None outputs (gradients of inputs that need none) to no buffer, which it cannot order."""
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return node
    for user in node.users:
        if user.target is operator.getitem and isinstance(user.meta.get("val"), torch.Tensor):
            node.append(user)  # right after the call, before anything ordered after it
            return user
    return None


def _first_compute_not_reading(nodes: list[Node], i: int) -> Optional[Node]:
    """The first compute node after `nodes[i]` that reads nothing computed from it, or None."""
    reading = {nodes[i]}
    for j in range(i + 1, len(nodes)):
        node = nodes[j]
        if any(a in reading for a in node.all_input_nodes):
            reading.add(node)
        elif _kind(node) is OpKind.COMPUTE:
            return node
    return None


def pin_order(gm: GraphModule) -> GraphModule:
    """Make the collectives' order binding for Inductor's scheduler, with `control_deps` edges.

    Assumes: the graph is in the order to keep (run after `reorder_for_overlap`), about to be lowered
    by Inductor. Guarantees: each collective gets an edge to the compute node after it (it is issued
    before that compute) and from the compute node before it (no deeper prefetch than planned: the
    memory budget holds), and each wait an edge from the compute node and the collective before it
    (it is not hoisted above either) and to the compute node after it (not sunk: the memory it
    frees is freed where the schedule planned), so the overlap windows and the planned peak survive
    Inductor's reordering. Values unchanged.
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if not any(is_collective(n) for n in nodes):
        return gm
    compute = [i for i, n in enumerate(nodes) if _kind(n) is OpKind.COMPUTE]
    index = {n: i for i, n in enumerate(nodes)}
    issued = [i for i, n in enumerate(nodes) if is_collective(n)]
    deps: dict[Node, OrderedSet[Node]] = {}

    for i, node in enumerate(nodes):
        if is_collective(node):
            k = bisect.bisect_right(compute, i)
            if k < len(compute):
                after = nodes[compute[k]]
                if node not in after.all_input_nodes:
                    deps.setdefault(after, OrderedSet()).add(node)
            # The compute before it that is not its own input (copy-in): Inductor may fuse the
            # copy-ins of several buckets into one kernel, which frees the later collectives to
            # move up to it.
            before = _last_compute_not_feeding(node, nodes, compute, k, index)
            if before is not None:
                deps.setdefault(node, OrderedSet()).add(before)
        elif is_wait_tensor(node) and collective_of(node) is not None:
            k = bisect.bisect_left(compute, i) - 1
            if k >= 0:
                before = nodes[compute[k]]
                deps.setdefault(node, OrderedSet()).add(before)
            # Also after the collective issued last before it: Inductor may fuse that compute node
            # into a kernel it runs later and drop the edge, but it never fuses a collective.
            k = bisect.bisect_left(issued, i) - 1
            if k >= 0 and nodes[issued[k]] is not collective_of(node):
                deps.setdefault(node, OrderedSet()).add(nodes[issued[k]])
            # And before the first compute node after it that does not read its result: Inductor
            # otherwise sinks a wait whose result only the graph's outputs read (a reduce-scatter's,
            # with its division) to the end, which keeps the full gradient bucket and gloo's copy of
            # it alive through the rest of the backward.
            after = _first_compute_not_reading(nodes, i)
            if after is not None:
                deps.setdefault(after, OrderedSet()).add(node)
    deps = {_anchor(n): OrderedSet(a for a in map(_anchor, before) if a is not None) for n, before in deps.items()}
    preserve_node_ordering(gm.graph, {n: before for n, before in deps.items() if n is not None and before})
    return gm
