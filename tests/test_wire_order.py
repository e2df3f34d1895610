"""`order_collectives_as` (passes/wire_order.py): a graph compiled again for a frame issues its
collectives in the order of the frame's first graph ([Note: One wire order per frame] in
fsdp_graph/compile/agreement.py). One process, a fake process group of 8 ranks."""

import torch

from _harness import fake_process_group
from _schedule_helpers import FIXED, LATENCY_BOUND, capture_graphs, sharded_stack
from fsdp_graph.passes.bucketing import auto_bucket, bucket_by_group
from fsdp_graph.passes.reorder import reorder_for_overlap
from fsdp_graph.passes.wire_order import eager_collectives, order_collectives_as, wire_order


def _backward_graphs(scheduled=True):
    """The backward of a three-block stack: in program order, and (`scheduled`) once more, scheduled
    for overlap (re-gathers prefetched, reduce-scatters early)."""
    with fake_process_group(8):
        program = bucket_by_group(capture_graphs(sharded_stack(), torch.randn(4, 16))["backward"])
        if not scheduled:
            return program, None
        graph = bucket_by_group(capture_graphs(sharded_stack(), torch.randn(4, 16))["backward"])
        return program, reorder_for_overlap(graph, FIXED, memory_budget_bytes=1 << 50)


def _positions(gm):
    return {n.name: i for i, n in enumerate(gm.graph.nodes)}


def _check_valid(gm):
    gm.graph.lint()  # every input defined before its use
    names = [n.name for n in gm.graph.nodes]
    assert names[-1] == "output"
    assert all(n.op == "placeholder" for n in list(gm.graph.nodes)[: sum(n.op == "placeholder" for n in gm.graph.nodes)])


def _matmuls(gm):
    return [n.name for n in gm.graph.nodes if n.name.startswith("mm")]


def test_collectives_take_the_order_given_and_the_rest_keeps_its_own():
    program, scheduled = _backward_graphs()
    assert wire_order(program) != wire_order(scheduled)  # else the test would show nothing
    nodes, matmuls = sorted(n.name for n in scheduled.graph.nodes), _matmuls(scheduled)
    # The schedule's graph in program order: the re-gathers go back down to their blocks.
    assert order_collectives_as(scheduled, wire_order(program))
    assert wire_order(scheduled) == wire_order(program)
    assert sorted(n.name for n in scheduled.graph.nodes) == nodes  # only moved, nothing added or lost
    assert _matmuls(scheduled) == matmuls
    _check_valid(scheduled)
    # And the other way: the all-gathers move up to where the schedule issues them.
    program_matmuls = _matmuls(program)
    _, target = _backward_graphs()
    assert order_collectives_as(program, wire_order(target))
    assert wire_order(program) == wire_order(target)
    assert _matmuls(program) == program_matmuls
    _check_valid(program)


def test_an_order_the_data_forbids_leaves_the_graph_as_it_was():
    program, _ = _backward_graphs(scheduled=False)
    order = wire_order(program)
    # A block's reduce-scatter before its own re-gather: its gradient needs the gathered weights.
    first_rs = next(i for i, label in enumerate(order) if label.startswith("reduce_scatter"))
    impossible = (order[first_rs],) + order[:first_rs] + order[first_rs + 1:]
    before = [n.name for n in program.graph.nodes]
    assert not order_collectives_as(program, impossible)
    assert [n.name for n in program.graph.nodes] == before
    assert not order_collectives_as(program, order[:-1])  # other collectives: refused too


def test_another_model_with_the_same_names_records_its_own_order(caplog):
    """Records are kept per root and backend options: a second model whose frame Dynamo numbers
    as the first's (after `torch._dynamo.reset()`) and whose groups have the same names is a first
    compile, not a recompile of the first model's frame (in the suite, an earlier test's order was
    imposed on test_passes_inductor's graph)."""
    import logging

    import fsdp_graph

    with fake_process_group(8), caplog.at_level(logging.INFO, logger="fsdp_graph.compile.agreement"):
        for options in ({"disabled_passes": {"reorder_for_overlap"}}, {}):
            torch._dynamo.reset()
            compiled = torch.compile(sharded_stack(), backend=fsdp_graph.backend(compiler="aot_eager", **options))
            compiled(torch.randn(4, 16)).sum().backward()
    assert not [r for r in caplog.records if "recompiles a frame" in r.getMessage()]


def test_the_eager_hooks_plan_holds_each_groups_collectives_merged_or_in_pieces():
    """A rank that runs the step on the eager hooks issues each group's collectives where the
    graph's order has them ([Note: A fallback keeps the frame's wire order] in
    runtime/wire_plan.py): that order as (collective, groups, piece), with the groups `auto_bucket`
    merged into one collective and the pieces it cut a bucket into."""
    program, scheduled = _backward_graphs()
    gather, reduce = "all_gather", "reduce_scatter"
    assert eager_collectives(wire_order(scheduled)) == (
        (gather, ("blocks.2",), None), (gather, ("blocks.1",), None), (reduce, ("blocks.2",), None),
        (gather, ("blocks.0",), None), (reduce, ("blocks.1",), None), (reduce, ("<root>",), None),
        (reduce, ("blocks.0",), None))  # each re-gather prefetched: the hooks' order it is not
    with fake_process_group(8):
        merged = auto_bucket(bucket_by_group(capture_graphs(sharded_stack(), torch.randn(4, 16))["backward"]), LATENCY_BOUND,
                             bucket_cap_bytes=1 << 20)
        split = auto_bucket(bucket_by_group(capture_graphs(sharded_stack(), torch.randn(4, 16))["backward"]), FIXED,
                            bucket_cap_bytes=64)
    plan = eager_collectives(wire_order(merged))
    assert plan is not None and any(len(groups) > 1 for _, groups, _ in plan)
    assert sorted(g for kind, groups, _ in plan if kind == reduce for g in groups) == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    plan = eager_collectives(wire_order(split))
    pieces = [(kind, groups, piece) for kind, groups, piece in plan if piece is not None]
    assert pieces and all(len(groups) == 1 for _, groups, _ in plan)
    for kind, groups, (k, n) in pieces:  # every piece of a cut bucket, once
        assert sorted(p[0] for c, g, p in pieces if (c, g) == (kind, groups)) == list(range(n))
    # HSDP's all-reduce of a group's reduced shard over the replicas, in its place.
    assert eager_collectives(("reduce_scatter_tensor.default a", "all_gather_into_tensor_out.default b",
                              "all_reduce.default a")) == (
        (reduce, ("a",), None), (gather, ("b",), None), ("all_reduce", ("a",), None))
    # Another parallelism's collectives, which the model's code issues: named, for the runtime to
    # check that they run on process groups of their own.
    assert eager_collectives(("all_gather_into_tensor a", "all_reduce [tp]", "all_gather_into_tensor [tp] chunk 1/2")) == (
        (gather, ("a",), None), ("other", ("tp",), None), ("other", ("tp",), None))
    # What the hooks cannot issue in the graph's order: a bucket twice, a group's collective of another kind.
    assert eager_collectives(("broadcast a",)) is None
    assert eager_collectives(("all_reduce.default a", "all_reduce.default a")) is None
    assert eager_collectives(("all_reduce.default a+b",)) is None
    assert eager_collectives(("all_gather_into_tensor a", "all_gather_into_tensor a")) is None
    assert eager_collectives(("reduce_scatter_tensor a piece 1/2",)) is None  # a piece missing
