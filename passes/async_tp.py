"""Asynchronous tensor parallelism: a row-parallel matmul and its all-reduce, decomposed into chunks.

A row-parallel linear (tensor parallelism's `RowwiseParallel` without sequence parallelism) computes
a partial sum on each tp rank and all-reduces it; in backward, a column-parallel linear's input
gradient is all-reduced the same way. Traced, each is

    mm(A, B) -> views -> all_reduce -> wait -> first user          (or addmm(bias, A, B), with a bias)

and the all-reduce cannot start before the whole matmul has finished, nor the computation after it
before the whole all-reduce has. This pass splits A's rows (the tokens) into `num_chunks` and gives
each chunk its own matmul and all-reduce, so that chunk c's all-reduce runs on the tp stream while
chunk c+1 is multiplied:

    mm(A[0]) AR(0) mm(A[1]) AR(1) ... mm(A[n-1]) AR(n-1) ... wait(0..n-1) -> cat -> views -> first user

The waits go to just before the first user of the original wait, so any computation that does not
need the result (in backward: the weight gradients next to it) also runs under the all-reduces.

[Note: Async TP numbers]
Row chunks change no summation order: every output element is the same dot product over the same
inner dimension, and the all-reduce sums the same per-rank values elementwise. The result is the
same bit for bit wherever the matmul kernel does not change its inner blocking with the number of
rows (tests/test_tensor_parallel.py checks the compiled 2x2 training with and without the pass).

Assumes: forward or backward graphs after partitioning; tensor parallelism's all-reduces are those
that are not FSDP's (`is_fsdp_collective`). Guarantees: only matmul -> all-reduce pairs where the
matmul, and each view between it and the all-reduce, has no other user are rewritten; a matmul with
fewer rows than `num_chunks` is split into as many chunks as it has rows, one with one row is left
alone. Each new node carries `PASS_META = "async_tp"`; each chunked all-reduce `ASYNC_TP_META`
(chunk index, number of chunks), which the inspector shows as "[tp] chunk 2/4" in the tp lane.

All-gather -> matmul and matmul -> reduce-scatter (sequence parallelism) are not decomposed here: on
CUDA, `async_tp_on_cuda` hands them to torch's micro-pipeline pass, which fuses them with symmetric
memory where the tp group has it enabled.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from .nodes import ASYNC_TP_META, C10D, PASS_META, is_all_reduce, is_fsdp_collective, wait_of

logger = logging.getLogger(__name__)

_ATEN = torch.ops.aten
PASS_NAME = "async_tp"
MERGE_PASS_NAME = "merge_tp_all_reduces"
DEFAULT_NUM_CHUNKS = 4
_VIEWS = (_ATEN.view.default, _ATEN._unsafe_view.default, _ATEN.reshape.default)
_MATMULS = (_ATEN.mm.default, _ATEN.addmm.default)  # addmm: a rowwise layer's bias added before the sum


def _chunk_matmul(graph, mm: Node, start: int, end: int) -> Node:
    """`mm` (an `mm(A, B)` or `addmm(bias, A, B)`) on rows start:end of A only."""
    if mm.target is _ATEN.mm.default:
        lhs, rhs = mm.args
        return _add(graph, _ATEN.mm.default, (_add(graph, _ATEN.slice.Tensor, (lhs, 0, start, end)), rhs))
    bias, lhs, rhs = mm.args
    if bias.meta["val"].dim() == 2 and bias.meta["val"].shape[0] != 1:  # one bias row per row of A
        bias = _add(graph, _ATEN.slice.Tensor, (bias, 0, start, end))
    rows = _add(graph, _ATEN.slice.Tensor, (lhs, 0, start, end))
    return _add(graph, _ATEN.addmm.default, (bias, rows, rhs), mm.kwargs)


def is_tp_all_reduce(node: Node) -> bool:
    """An all-reduce that is not FSDP's: tensor parallelism's (or the user's)."""
    return is_all_reduce(node) and not is_fsdp_collective(node)


def _summed_matmuls(node: Node) -> Optional[list[Node]]:
    """The matmuls whose outputs `node` sums, if it is (views of) one 2-D matmul or an `add` of such
    sums, all of the same shape and each intermediate used by nothing else; else None."""
    if not (isinstance(node, Node) and node.op == "call_function") or len(node.users) != 1:
        return None
    if node.target in _VIEWS:
        return _summed_matmuls(node.args[0])
    if node.target in _MATMULS:
        return [node]
    if node.target is _ATEN.add.Tensor and not node.kwargs and len(node.args) == 2:
        a, b = node.args
        if not (isinstance(a, Node) and isinstance(b, Node)) or a.meta["val"].shape != b.meta["val"].shape:
            return None
        terms = [_summed_matmuls(a), _summed_matmuls(b)]
        if None in terms or terms[0][0].meta["val"].shape != terms[1][0].meta["val"].shape:
            return None
        return terms[0] + terms[1]
    return None


def _chunk_bounds(num_rows: int, num_chunks: int) -> list[tuple[int, int]]:
    num_chunks = min(num_chunks, num_rows)
    bounds, start = [], 0
    for c in range(num_chunks):
        size = num_rows // num_chunks + (1 if c < num_rows % num_chunks else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _add(graph, target, args, kwargs=None, pass_name: str = PASS_NAME) -> Node:
    """A new node of this pass, with its fake value computed from its inputs' values."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    node.meta["val"] = target(*vals, **(kwargs or {}))
    node.meta[PASS_META] = pass_name
    return node


class _Positions:
    """Node positions, computed once and again only when asked about a node made since: inserting
    nodes keeps the order of the others, so one pass stays linear in the graph's size."""

    def __init__(self, graph) -> None:
        self.graph = graph
        self.index = {}

    def latest(self, nodes) -> Node:
        return max(nodes, key=self._of)

    def earliest(self, nodes) -> Node:
        return min(nodes, key=self._of)

    def _of(self, node: Node) -> int:
        if node not in self.index:
            self.index = {n: i for i, n in enumerate(self.graph.nodes)}
        return self.index[node]


def _decompose(gm: GraphModule, all_reduce: Node, num_chunks: int, positions: _Positions) -> bool:
    matmuls = _summed_matmuls(all_reduce.args[0])
    wait = wait_of(all_reduce)
    if matmuls is None or wait is None or len(all_reduce.users) != 1 or not wait.users:
        return False
    num_rows = matmuls[0].meta["val"].shape[0]
    if not isinstance(num_rows, int) or num_rows < 2:
        return False
    bounds = _chunk_bounds(num_rows, num_chunks)
    graph = gm.graph
    op, group = all_reduce.args[1], all_reduce.args[2]
    # Every element of the all-reduced tensor is, through views that only reinterpret the matmuls'
    # row-major [rows, cols] outputs, the sum of the same element of each matmul: chunk c of the
    # rows is the sum of each matmul's chunk c.
    # Issued as early as the matmuls' inputs allow: computation that stayed after (in backward, the
    # weight gradients of the same layers) then runs under the chunks' all-reduces too.
    inputs = [a for mm in matmuls for a in mm.all_input_nodes]
    reduced = []
    with graph.inserting_before(positions.latest(inputs).next):
        for c, (start, end) in enumerate(bounds):
            summed = _chunk_matmul(graph, matmuls[0], start, end)
            for mm in matmuls[1:]:
                summed = _add(graph, _ATEN.add.Tensor, (summed, _chunk_matmul(graph, mm, start, end)))
            chunk = _add(graph, C10D.all_reduce.default, (summed, op, group))
            chunk.meta[ASYNC_TP_META] = (c, len(bounds))
            reduced.append(chunk)
    shape = list(all_reduce.meta["val"].shape)
    with graph.inserting_before(positions.earliest(wait.users)):
        waits = [_add(graph, C10D.wait_tensor.default, (chunk,)) for chunk in reduced]
        out = _add(graph, _ATEN.view.default, (_add(graph, _ATEN.cat.default, (waits, 0)), shape))
    wait.replace_all_uses_with(out)
    dead = [wait, all_reduce]
    while dead:
        node = dead.pop(0)
        inputs = node.all_input_nodes
        graph.erase_node(node)
        dead += [n for n in inputs if not n.users and n.op == "call_function" and n not in dead]
    return True


def decompose_tp_matmuls(gm: GraphModule, num_chunks: int = DEFAULT_NUM_CHUNKS) -> GraphModule:
    """Split every tensor-parallel matmul -> all-reduce of `gm` into `num_chunks` row chunks (see
    the module docstring)."""
    if num_chunks < 2 or not any(is_tp_all_reduce(n) for n in gm.graph.nodes):
        return gm
    candidates = [n for n in gm.graph.nodes if is_tp_all_reduce(n)]
    positions = _Positions(gm.graph)
    num_done = sum(_decompose(gm, n, num_chunks, positions) for n in candidates)
    logger.debug("fsdp_graph::async_tp %d of %d tp all-reduces decomposed into %d chunks",
                 num_done, len(candidates), num_chunks)
    return gm


def _reduced_by(node: Node) -> Optional[tuple[Node, list[Node]]]:
    """(tp all-reduce, views from its wait to `node`) if `node` is (views of) such an all-reduce's
    wait, each used by nothing else; else None."""
    views = []
    while node.op == "call_function" and node.target in _VIEWS and len(node.users) == 1:
        views.append(node)
        node = node.args[0]
    if not (node.op == "call_function" and node.target is C10D.wait_tensor.default and len(node.users) == 1):
        return None
    all_reduce = node.args[0]
    if not (is_tp_all_reduce(all_reduce) and len(all_reduce.users) == 1 and all_reduce.args[1] == "sum"):
        return None
    return all_reduce, views[::-1]


def _merge(gm: GraphModule, add: Node) -> bool:
    if add.target is not _ATEN.add.Tensor or add.kwargs or len(add.args) != 2:
        return False
    if not all(isinstance(a, Node) for a in add.args) or add.args[0].meta["val"].shape != add.args[1].meta["val"].shape:
        return False
    found = [_reduced_by(a) for a in add.args]
    if None in found or found[0][0].args[2] != found[1][0].args[2]:
        return False
    graph = gm.graph
    with graph.inserting_before(add):
        inputs = []
        for all_reduce, views in found:
            x = all_reduce.args[0]
            for view in views:  # the same reinterpretation, before the sum instead of after
                x = _add(graph, view.target, (x, *view.args[1:]), pass_name=MERGE_PASS_NAME)
            inputs.append(x)
        summed = _add(graph, _ATEN.add.Tensor, tuple(inputs), pass_name=MERGE_PASS_NAME)
        group = found[0][0].args[2]
        merged = _add(graph, C10D.all_reduce.default, (summed, "sum", group), pass_name=MERGE_PASS_NAME)
        wait = _add(graph, C10D.wait_tensor.default, (merged,), pass_name=MERGE_PASS_NAME)
    add.replace_all_uses_with(wait)
    graph.erase_node(add)
    for all_reduce, views in found:
        chain = [*reversed(views), wait_of(all_reduce), all_reduce]
        for node in chain:
            graph.erase_node(node)
    return True


def merge_summed_all_reduces(gm: GraphModule) -> GraphModule:
    """Sum before all-reducing: `AR(a) + AR(b)` becomes `AR(a + b)`, one all-reduce instead of two.

    In backward, each column-parallel layer all-reduces its own partial input gradient, and autograd
    then adds them up (attention's wq, wk and wv: three all-reduces of a full activation's size; the
    MLP's w1 and w3: two). Assumes: sum all-reduces of tensor parallelism on one group whose waits
    feed only that add (through views that only reinterpret the shape). Guarantees: each such add
    tree becomes one all-reduce of the summed inputs. The sums are then taken per rank first and
    across ranks after: a different order of the same additions, which changes the result within
    rounding ([Note: Async TP numbers]); disable "merge_tp_all_reduces" to keep the traced order.
    """
    num_merged = 0
    changed = True
    while changed:  # a tree (a + b) + c merges from the inside out
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is _ATEN.add.Tensor and _merge(gm, node):
                num_merged += 1
                changed = True
    if num_merged:
        logger.debug("fsdp_graph::merge_tp_all_reduces %d all-reduces fewer", num_merged)
    return gm


def async_tp_on_cuda(example_inputs: list) -> dict:
    """Inductor config patches that turn torch's fused symmetric-memory ops on for the sequence
    parallel patterns when the graph runs on CUDA; empty elsewhere. torch's pass fuses only groups
    with symmetric memory enabled and leaves the others alone. Untested here (no GPU)."""
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return {"_micro_pipeline_tp": True} if on_cuda else {}
