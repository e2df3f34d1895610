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

from .nodes import ASYNC_TP_META, PASS_META, is_all_reduce, is_fsdp_collective, wait_of

logger = logging.getLogger(__name__)

_ATEN = torch.ops.aten
_C10D = torch.ops._c10d_functional
PASS_NAME = "async_tp"
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


def _matmul_into(all_reduce: Node) -> Optional[tuple[Node, list[Node]]]:
    """(mm, views from it to `all_reduce`'s input, in order) if the all-reduce reduces a 2-D matmul
    through views only, each used by nothing else; else None."""
    views = []
    node = all_reduce.args[0]
    while isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS:
        if len(node.users) != 1:
            return None
        views.append(node)
        node = node.args[0]
    if not (isinstance(node, Node) and node.op == "call_function" and node.target in _MATMULS):
        return None
    if len(node.users) != 1:
        return None
    return node, views[::-1]


def _chunk_bounds(num_rows: int, num_chunks: int) -> list[tuple[int, int]]:
    num_chunks = min(num_chunks, num_rows)
    bounds, start = [], 0
    for c in range(num_chunks):
        size = num_rows // num_chunks + (1 if c < num_rows % num_chunks else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _add(graph, target, args, kwargs=None) -> Node:
    """A new node of this pass, with its fake value computed from its inputs' values."""
    node = graph.call_function(target, args, kwargs)
    vals = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    node.meta["val"] = target(*vals, **(kwargs or {}))
    node.meta[PASS_META] = PASS_NAME
    return node


def _first_user(wait: Node) -> Node:
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    return min(wait.users, key=order.__getitem__)


def _decompose(gm: GraphModule, all_reduce: Node, num_chunks: int) -> bool:
    found = _matmul_into(all_reduce)
    wait = wait_of(all_reduce)
    if found is None or wait is None or len(all_reduce.users) != 1 or not wait.users:
        return False
    mm, views = found
    num_rows = mm.meta["val"].shape[0]
    if not isinstance(num_rows, int) or num_rows < 2:
        return False
    bounds = _chunk_bounds(num_rows, num_chunks)
    graph = gm.graph
    op, group = all_reduce.args[1], all_reduce.args[2]
    reduced = []
    with graph.inserting_before(mm):
        for c, (start, end) in enumerate(bounds):
            product = _chunk_matmul(graph, mm, start, end)
            chunk = _add(graph, _C10D.all_reduce.default, (product, op, group))
            chunk.meta[ASYNC_TP_META] = (c, len(bounds))
            reduced.append(chunk)
    with graph.inserting_before(_first_user(wait)):
        waits = [_add(graph, _C10D.wait_tensor.default, (chunk,)) for chunk in reduced]
        out = _add(graph, _ATEN.cat.default, (waits, 0))
        for view in views:
            out = _add(graph, view.target, (out, *view.args[1:]))
    wait.replace_all_uses_with(out)
    for node in (wait, all_reduce, *reversed(views), mm):
        graph.erase_node(node)
    return True


def decompose_tp_matmuls(gm: GraphModule, num_chunks: int = DEFAULT_NUM_CHUNKS) -> GraphModule:
    """Split every tensor-parallel matmul -> all-reduce of `gm` into `num_chunks` row chunks (see
    the module docstring)."""
    if num_chunks < 2 or not any(is_tp_all_reduce(n) for n in gm.graph.nodes):
        return gm
    candidates = [n for n in gm.graph.nodes if is_tp_all_reduce(n)]
    num_done = sum(_decompose(gm, n, num_chunks) for n in candidates)
    logger.debug("fsdp_graph::async_tp %d of %d tp all-reduces decomposed into %d chunks",
                 num_done, len(candidates), num_chunks)
    gm.graph.lint()
    gm.recompile()
    return gm


def async_tp_on_cuda(example_inputs: list) -> dict:
    """Inductor config patches that turn torch's fused symmetric-memory ops on for the sequence
    parallel patterns when the graph runs on CUDA; empty elsewhere. torch's pass fuses only groups
    with symmetric memory enabled and leaves the others alone. Untested here (no GPU)."""
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return {"_micro_pipeline_tp": True} if on_cuda else {}
