"""The order a scheduled graph issues its collectives in (its wire order), and a reordering that
makes a graph issue them in a given one.

Ranks must issue the collectives of a process group in one order. A graph compiled again for new
shapes (a rank recompiling alone while the others run the graph they compiled before) is scheduled
with other costs, and its collectives may come out in another order than the graph the other ranks
run: [Note: One wire order per frame] in fsdp_graph/compile/agreement.py. `order_collectives_as`
moves nodes so that the collectives come in the order given, keeping every data dependency and the
order of every node that writes a tensor others read; the schedule's overlap is kept wherever the
given order allows it.
"""

from __future__ import annotations

import heapq
from typing import Optional

from torch.fx import GraphModule, Node

from ..runtime.wire_plan import ALL_REDUCE, GATHER, OTHER, REDUCE, Collective
from .nodes import collective_label, is_collective, owned_by


def wire_order(gm: GraphModule) -> tuple[str, ...]:
    """The collectives of `gm` in graph order, each as its op and the groups or parallelism it
    serves (`collective_label`): what another rank's graph must issue in the same order."""
    return tuple(_wire_label(n) for n in gm.graph.nodes if is_collective(n))


def gathered_groups(order: tuple[str, ...]) -> frozenset[str]:
    """The FSDP groups whose parameters the collectives of a wire order (`wire_order`) gather."""
    groups: set[str] = set()
    for label in order:
        kind, carried, _ = _read_label(label)
        if kind == GATHER:
            groups.update(carried)
    return frozenset(groups)


def eager_collectives(order: tuple[str, ...]) -> Optional[tuple[Collective, ...]]:
    """A wire order (`wire_order`) as the eager hooks can issue it (runtime/wire_plan.py): each
    group's all-gather and reduce-scatter once, alone, merged with other groups' (`auto_bucket`) or
    in pieces, HSDP's all-reduce of a group once, and another parallelism's collectives as OTHER
    items naming it (the model's code issues those). None if it holds a group's bucket twice or a
    collective of the graph's own: those the hooks cannot keep in the graph's order."""
    items: list[Collective] = []
    pieces: dict[tuple[str, str], list[Optional[tuple[int, int]]]] = {}  # per (op, group); [None]: whole
    for label in order:
        kind, carried, piece = _read_label(label)
        if kind == OTHER:
            items.append((OTHER, tuple(carried), None))
            continue
        if kind is None or not carried or len(set(carried)) != len(carried) or (piece and len(carried) > 1):
            return None
        if kind == ALL_REDUCE and (piece or len(carried) > 1):
            return None
        for group in carried:
            pieces.setdefault((kind, group), []).append(piece)
        items.append((kind, tuple(carried), piece))
    for seen in pieces.values():
        if seen != [None] and (None in seen or sorted(seen) != [(k, seen[0][1]) for k in range(seen[0][1])]):
            return None  # a bucket twice, or not every piece of it once
    return tuple(items)


def _read_label(label: str) -> tuple[Optional[str], list[str], Optional[tuple[int, int]]]:
    """A `wire_order` label read back: GATHER, REDUCE or ALL_REDUCE (None for another op) and the FSDP
    groups the collective carries, with (k, n) for piece k of n of a split bucket (`collective_label`
    counts pieces from 1); or OTHER and the parallelism whose collective it is ("[tp]")."""
    op, _, rest = label.partition(" ")
    kind = next((k for k in (GATHER, REDUCE, ALL_REDUCE) if op.startswith(k)), None)
    if rest.startswith("["):
        return OTHER, [rest[1:].partition("]")[0]], None
    if not rest:
        return kind, [], None
    carried, _, piece = rest.partition(" piece ")
    if not piece:
        return kind, carried.split("+"), None
    k, _, n = piece.partition("/")
    return kind, carried.split("+"), (int(k) - 1, int(n))


def _wire_label(node: Node) -> str:
    """One collective as `wire_order` spells it."""
    return f"{getattr(node.target, '__name__', str(node.target))} {collective_label(node)}"


def _is_barrier(node: Node) -> bool:
    """A node that writes a tensor other nodes may read: no node crosses it. One that writes only
    a fresh buffer of its own is not (gloo's all-gather into a new tensor, passes/gloo.py): the
    collectives it must be issued between are free to move around it."""
    if node.op != "call_function":
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return False
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.kwargs[argument.name] if argument.name in node.kwargs else (
            node.args[i] if i < len(node.args) else None)
        if not (isinstance(value, Node) and owned_by(value, node)):
            return True
    return False


def order_collectives_as(gm: GraphModule, order: tuple[str, ...]) -> bool:
    """Reorder `gm`'s nodes so that its collectives are issued in `order` (as `wire_order` spells
    it). Every other node keeps its place relative to the others as far as the collectives allow
    (a list schedule by original position, where a collective is ready only when it is next in
    `order`); a node that writes a tensor others read is a barrier no node crosses. Returns False,
    leaving `gm` as it was, when its collectives are not those of `order` or cannot come in that
    order."""
    nodes = list(gm.graph.nodes)
    labels = {n: _wire_label(n) for n in nodes if is_collective(n)}
    if sorted(labels.values()) != sorted(order):
        return False
    if tuple(labels.values()) == tuple(order):
        return True
    position = {n: i for i, n in enumerate(nodes)}
    waiting_for = {n: len(set(n.all_input_nodes)) for n in nodes}
    barriers = [position[n] for n in nodes if _is_barrier(n)] + [len(nodes)]
    ready: list[int] = []  # positions of nodes whose inputs are all placed
    held: dict[str, list[int]] = {}  # ready collectives by label, until they are next in `order`
    placed: list[Node] = []
    issued = 0  # collectives placed
    done = [False] * len(nodes)
    lowest_open = 0  # every node before this position is placed
    next_barrier = 0  # index into `barriers` of the first one not yet placed

    def make_ready(node: Node) -> None:
        if node in labels:
            heapq.heappush(held.setdefault(labels[node], []), position[node])
        else:
            heapq.heappush(ready, position[node])

    for node in nodes:
        if waiting_for[node] == 0:
            make_ready(node)
    while len(placed) < len(nodes):
        wanted = order[issued] if issued < len(order) else None
        candidates = []
        if ready:
            candidates.append(ready[0])
        if wanted is not None and held.get(wanted):
            candidates.append(held[wanted][0])
        # A barrier goes only when everything before it is placed; nothing after it goes before it.
        limit = barriers[next_barrier]
        candidates = [p for p in candidates if p < limit or (p == limit and lowest_open == p)]
        if not candidates:
            return False
        pick = min(candidates)
        if ready and ready[0] == pick:
            heapq.heappop(ready)
        else:
            heapq.heappop(held[wanted])
            issued += 1
        node = nodes[pick]
        placed.append(node)
        done[pick] = True
        while lowest_open < len(nodes) and done[lowest_open]:
            lowest_open += 1
        if pick == limit:
            next_barrier += 1
        for user in node.users:
            waiting_for[user] -= 1
            if waiting_for[user] == 0:
                make_ready(user)
    output = gm.graph.output_node()
    for node in placed:
        if node is not output:
            output.prepend(node)
    gm.graph.lint()
    gm.recompile()
    return True
