"""Bucket collectives: one per communication group (the default plan), or merged and split by the
cost model (auto-bucketing). Both run on the partitioned forward and backward graphs.

A bucket's layout is the eager runtime's (see [Note: Traced unshard] in traced/unshard.py): each
rank contributes a flat 1-D shard, and the all-gather output is rank-major, `(world, shard_numel)`.
Merging buckets `a` and `b` therefore concatenates the flat inputs, gathers once, and cuts each old
output back out of the rank-major rows:

    all-gather:     out_a = view(AG(cat(in_a, in_b)), (world, n_a + n_b))[:, :n_a]  (copied, flat)
    reduce-scatter: RS(cat(view(in_a, (world, n_a)), view(in_b, (world, n_b)), dim=1)) = [rs_a, rs_b]

and splitting is the inverse. Every element is summed over the same ranks as before, so results
are bitwise equal to the unmerged graph; only copies are added.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from .cost_model import CostModel, op_facts
from .nodes import (
    BUCKET_META,
    C10D,
    bucket_groups,
    PASS_META,
    PIECE_META,
    group_of,
    is_all_gather,
    is_fsdp_collective,
    is_reduce_scatter,
    size_hint,
    wait_of,
)

logger = logging.getLogger(__name__)

aten = torch.ops.aten


# -- graph editing helpers ------------------------------------------------------------------------------


def _call(gm: GraphModule, target, args: tuple, pass_name: str, like: Optional[Node] = None) -> Node:
    """Insert `target(*args)` at the graph's insert point, with `meta["val"]` from the fake values."""
    node = gm.graph.call_function(target, args)
    vals = pytree.tree_map_only(Node, lambda n: n.meta["val"], args)
    mode = detect_fake_mode(pytree.tree_leaves(vals))
    with mode if mode is not None else nullcontext():
        node.meta["val"] = target(*vals)
    node.meta[PASS_META] = pass_name
    if like is not None and "custom" in like.meta:
        node.meta["custom"] = dict(like.meta["custom"])
    return node


def _label(node: Node, groups: Sequence[str]) -> None:
    node.meta[BUCKET_META] = tuple(groups)


def _key(node: Node) -> tuple:
    """Collectives with equal keys can share a bucket: same op, group, world, reduction and dtype."""
    if is_all_gather(node):
        return ("all_gather", node.args[1], node.args[2], node.args[0].meta["val"].dtype)
    return ("reduce_scatter", node.args[1], node.args[2], node.args[3], node.args[0].meta["val"].dtype)


def _flat_numel(node: Node) -> Optional[int]:
    """Per-rank element count of a bucketable collective's flat 1-D input; None if not flat."""
    val = node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 1:
        return None
    numel = size_hint(val.numel())  # [Note: Plans from size hints] in passes/nodes.py
    return numel if is_all_gather(node) else numel // int(node.args[2])


def _ancestors_after(node: Node, anchor: Node, position: dict[Node, int]) -> Optional[list[Node]]:
    """Nodes `node` depends on that come at or after `anchor`, in graph order, if they can all move
    before `anchor`; None if one of them depends on something at or after `anchor` that cannot."""
    limit = position[anchor]
    found: set[Node] = set()
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in found or position[n] < limit:
            continue
        if n.op == "placeholder":
            continue
        if n.op != "call_function" or n is anchor:
            return None
        found.add(n)
        stack.extend(n.all_input_nodes)
    return sorted(found, key=position.__getitem__)


def _downstream(node: Node) -> set[Node]:
    seen: set[Node] = set()
    stack = list(node.users)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        stack.extend(n.users)
    return seen


# -- merging and splitting ------------------------------------------------------------------------------


def _merge_all_gathers(gm: GraphModule, bucket: list[Node], pass_name: str) -> Optional[Node]:
    """One all-gather for `bucket` (in graph order), issued where the first one was."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    first = bucket[0]
    to_move: list[Node] = []
    for ag in bucket[1:]:
        moved = _ancestors_after(ag.args[0], first, position)
        if moved is None:
            return None
        to_move += [n for n in moved if n not in to_move] + ([ag.args[0]] if position[ag.args[0]] > position[first] else [])
    for n in sorted(set(to_move), key=position.__getitem__):
        first.prepend(n)
    world, group_name = first.args[1], first.args[2]
    sizes = [_flat_numel(ag) for ag in bucket]
    waits = [wait_of(ag) for ag in bucket]
    with gm.graph.inserting_before(first):
        flat = _call(gm, aten.cat.default, ([ag.args[0] for ag in bucket],), pass_name)
        merged = _call(gm, C10D.all_gather_into_tensor.default, (flat, world, group_name), pass_name, like=first)
    first_wait = min(waits, key=lambda w: position[w])
    with gm.graph.inserting_before(first_wait):
        wait = _call(gm, C10D.wait_tensor.default, (merged,), pass_name, like=first_wait)
        rows = _call(gm, aten.view.default, (wait, [world, sum(sizes)]), pass_name)
        offset = 0
        for old_wait, numel in zip(waits, sizes):
            cols = _call(gm, aten.slice.Tensor, (rows, 1, offset, offset + numel), pass_name)
            copy = _call(gm, aten.clone.default, (cols,), pass_name)
            out = _call(gm, aten.view.default, (copy, [world * numel]), pass_name)
            old_wait.replace_all_uses_with(out)
            offset += numel
    for old_wait, ag in zip(waits, bucket):
        gm.graph.erase_node(old_wait)
        gm.graph.erase_node(ag)
    _label(merged, [g for ag in bucket for g in bucket_groups(ag)])
    return merged


def _merge_reduce_scatters(gm: GraphModule, bucket: list[Node], pass_name: str) -> Optional[Node]:
    """One reduce-scatter for `bucket` (in graph order), issued where the last one was."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = bucket[-1]
    waits = [wait_of(rs) for rs in bucket]
    # Everything computed from the earlier results must move after the merged one; none of it may
    # feed the last bucket's gradients.
    later: set[Node] = set()
    for wait in waits[:-1]:
        later |= {n for n in _downstream(wait) if position[n] < position[last]} | {wait}
    needed = set(_ancestors_after(last, bucket[0], position) or []) | {last.args[0]}
    if later & needed:
        return None
    _, reduce_op, world, group_name = last.args
    sizes = [_flat_numel(rs) for rs in bucket]
    with gm.graph.inserting_before(last.next):
        rows = [_call(gm, aten.view.default, (rs.args[0], [world, numel]), pass_name) for rs, numel in zip(bucket, sizes)]
        cat = _call(gm, aten.cat.default, (rows, 1), pass_name)
        flat = _call(gm, aten.view.default, (cat, [-1]), pass_name)
        merged = _call(gm, C10D.reduce_scatter_tensor.default, (flat, reduce_op, world, group_name), pass_name, like=last)
        wait = _call(gm, C10D.wait_tensor.default, (merged,), pass_name, like=waits[-1])
        anchor = wait
        offset = 0
        for old_wait, numel in zip(waits, sizes):
            piece = _call(gm, aten.slice.Tensor, (wait, 0, offset, offset + numel), pass_name)
            old_wait.replace_all_uses_with(piece)
            offset += numel
            anchor = piece
    for n in sorted(later - set(waits), key=position.__getitem__):
        anchor.append(n)
        anchor = n
    for old_wait, rs in zip(waits, bucket):
        gm.graph.erase_node(old_wait)
        gm.graph.erase_node(rs)
    _label(merged, [g for rs in bucket for g in bucket_groups(rs)])
    return merged


def _split(gm: GraphModule, node: Node, num_pieces: int, pass_name: str) -> list[Node]:
    """`num_pieces` collectives over consecutive column ranges of one bucket, reassembled in place."""
    numel = _flat_numel(node)
    world = node.args[1] if is_all_gather(node) else node.args[2]
    step = math.ceil(numel / num_pieces)
    bounds = [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]
    old_wait = wait_of(node)
    groups = bucket_groups(node)
    pieces, waits = [], []

    def gather(chunk: Node) -> Node:
        return _call(gm, C10D.all_gather_into_tensor.default, (chunk, world, node.args[2]), pass_name, like=node)

    with gm.graph.inserting_before(node):
        if is_all_gather(node):
            chunks = [_call(gm, aten.slice.Tensor, (node.args[0], 0, lo, hi), pass_name) for lo, hi in bounds]
            pieces = [gather(chunk) for chunk in chunks]
        else:
            rows = _call(gm, aten.view.default, (node.args[0], [world, numel]), pass_name)
            for lo, hi in bounds:
                cols = _call(gm, aten.slice.Tensor, (rows, 1, lo, hi), pass_name)
                flat = _call(gm, aten.view.default, (_call(gm, aten.clone.default, (cols,), pass_name), [-1]), pass_name)
                pieces.append(_call(gm, C10D.reduce_scatter_tensor.default, (flat, *node.args[1:]), pass_name, like=node))
    with gm.graph.inserting_before(old_wait):
        waits = [_call(gm, C10D.wait_tensor.default, (p,), pass_name, like=old_wait) for p in pieces]
        if is_all_gather(node):
            rows = [_call(gm, aten.view.default, (w, [world, hi - lo]), pass_name) for w, (lo, hi) in zip(waits, bounds)]
            out = _call(gm, aten.view.default, (_call(gm, aten.cat.default, (rows, 1), pass_name), [-1]), pass_name)
        else:
            out = _call(gm, aten.cat.default, (waits,), pass_name)
    old_wait.replace_all_uses_with(out)
    gm.graph.erase_node(old_wait)
    gm.graph.erase_node(node)
    for k, p in enumerate(pieces):
        _label(p, groups)
        p.meta[PIECE_META] = (k, len(pieces))
    return pieces


def _bucketable(gm: GraphModule) -> list[Node]:
    return [
        n for n in gm.graph.nodes
        if (is_all_gather(n) or is_reduce_scatter(n)) and is_fsdp_collective(n) and wait_of(n) is not None
        and _flat_numel(n) is not None
    ]


def _merge_runs(gm: GraphModule, pass_name: str, same_bucket: Callable[[list[Node], Node], bool]) -> int:
    """Merge consecutive bucketable collectives of one key while `same_bucket(bucket, next)`.
    Returns how many collectives were removed."""
    runs: dict[tuple, list[list[Node]]] = {}
    for node in _bucketable(gm):
        key = _key(node)
        chains = runs.setdefault(key, [[]])
        if chains[-1] and not same_bucket(chains[-1], node):
            chains.append([])
        chains[-1].append(node)
    num_removed = 0
    for chains in runs.values():
        for bucket in chains:
            if len(bucket) < 2:
                continue
            merge = _merge_all_gathers if is_all_gather(bucket[0]) else _merge_reduce_scatters
            if merge(gm, bucket, pass_name) is None:
                logger.debug("fsdp_graph::bucket not merged (%s): inputs not ready at the first", bucket_groups(bucket[0]))
                continue
            num_removed += len(bucket) - 1
    return num_removed


# -- the passes -----------------------------------------------------------------------------------------


def bucket_by_group(gm: GraphModule) -> GraphModule:
    """The default plan: one all-gather and one reduce-scatter per `fully_shard` group and graph.

    Assumes: a forward or backward graph whose collectives carry the traced runtime's group
    annotation. The traced runtime already emits one flat bucket per group and direction, exactly the
    eager runtime's, so normally this only labels each collective with its bucket (`BUCKET_META`).
    Guarantees: collectives of one group that are adjacent among that group's collectives of the same
    kind are merged into one (bitwise the same values); nothing else changes.
    """
    collectives = _bucketable(gm)
    if not collectives:
        return gm
    for node in collectives:
        node.meta.setdefault(BUCKET_META, (group_of(node) or "?",))
    num_removed = _merge_runs(gm, "bucket_by_group", lambda bucket, nxt: bucket_groups(bucket[-1]) == bucket_groups(nxt))
    if num_removed:
        logger.debug("fsdp_graph::bucket_by_group merged %d collectives", num_removed)
    return gm


def auto_bucket(gm: GraphModule, cost_model: CostModel, bucket_cap_bytes: int) -> GraphModule:
    """Merge small buckets and split large ones.

    Assumes: buckets as `bucket_by_group` leaves them. Guarantees:
    - consecutive collectives of one key (op, process group, dtype) are merged while each is
      latency-bound by `cost_model` (its transfer time is at most its latency) and the merged bucket
      stays within `bucket_cap_bytes`; an all-gather bucket is issued where its first member was,
      a reduce-scatter bucket where its last member was (when all its gradients exist);
    - a collective over `bucket_cap_bytes` is split into the fewest pieces within the cap;
    - values are bitwise the same (see the module docstring); decisions depend only on shapes.
    """
    collectives = _bucketable(gm)
    if not collectives:
        return gm

    def size(node: Node) -> int:
        return op_facts(node).collective_bytes

    def small(node: Node) -> bool:
        facts = op_facts(node)
        return cost_model.is_latency_bound(facts.collective, facts.collective_bytes, facts.world)

    def same_bucket(bucket: list[Node], nxt: Node) -> bool:
        return small(bucket[0]) and small(nxt) and sum(map(size, bucket)) + size(nxt) <= bucket_cap_bytes

    num_merged = _merge_runs(gm, "auto_bucket", same_bucket)
    num_split = 0
    for node in _bucketable(gm):
        if size(node) > bucket_cap_bytes:
            pieces = _split(gm, node, math.ceil(size(node) / bucket_cap_bytes), "auto_bucket")
            num_split += len(pieces) - 1
    if not num_merged and not num_split:
        return gm
    logger.debug("fsdp_graph::auto_bucket merged away %d and split off %d collectives", num_merged, num_split)
    return gm


def buckets(gm: GraphModule) -> list[dict]:
    """The graph's buckets in order: op, groups, bytes. For tests and the inspector."""
    found = []
    for node in gm.graph.nodes:
        if is_all_gather(node) or is_reduce_scatter(node):
            facts = op_facts(node)
            found.append({"op": facts.collective.value, "groups": list(bucket_groups(node)), "bytes": facts.collective_bytes})
    return found

