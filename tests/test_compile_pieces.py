"""The whole step compiled by Inductor in pieces (the backend's default, `pieces=True`): the computation
between collectives compiled once per structure ([Note: Pieces between the collectives] in
fsdp_graph/compile/pieces.py), against an unsharded model on the same global batch, compiled and
then loaded from AOTAutograd's cache ([Note: A step of pieces in AOTAutograd's cache])."""

import copy
import os

import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.fx.experimental.proxy_tensor import make_fx

import fsdp_graph
from fsdp_graph.compile.pieces import compile_pieces
from _harness import fake_process_group, run_ranks
from _models import check_grads_match, check_params_match, global_mean, shard_llama, tiny_llama
from fsdp_graph import fully_shard


def _train(reference, rank, world_size, lengths, regions="marked"):
    """AdamW steps over `lengths` of the unsharded `reference` and of its copy sharded and compiled
    in pieces, on the same global batches: the losses and gradients every step, then the parameters."""
    model = shard_llama(copy.deepcopy(reference), fully_shard)
    # auto_bucket off: every block keeps its own all-gather and reduce-scatter, so that each block's
    # computation is a piece of its own (auto_bucket merges the tiny blocks' buckets).
    compiled = torch.compile(model, backend=fsdp_graph.backend(disabled_passes={"auto_bucket"}, regions=regions))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    per_rank = 2
    for step, length in enumerate(lengths):
        tokens = torch.randint(0, 64, (per_rank * world_size, length + 1), generator=torch.Generator().manual_seed(step))
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        loss = F.cross_entropy(compiled(x[mine]).flatten(0, 1), y[mine].flatten())
        loss.backward()
        expected = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        expected.backward()
        got = global_mean(loss)
        assert abs(got - expected.item()) <= 1e-5 * abs(expected.item()), f"step {step}: {got} != {expected.item()}"
        # Inductor fuses and reorders arithmetic: gradients within its rounding
        check_grads_match(model, reference, rtol=1e-4, atol=1e-5)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    check_params_match(model, reference, rtol=1e-4, atol=1e-5)
    assert dict(model._fsdp_state.ctx.fallbacks) == {}, model._fsdp_state.ctx.fallbacks


def _compile_then_load(rank, world_size, cache_dir, regions):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # ranks fork from a server started before the test
    torch.manual_seed(0)
    # in float64: float32 rounding differs between CPUs (their vector widths), and AdamW, whose update
    # divides by the gradient's running size, carried it past the tolerances for one weight on an
    # AMD machine, where the gradients themselves matched; float64 keeps the check as tight everywhere
    initial = tiny_llama(6).double()
    counters.clear()
    # the first length compiles a static graph, the second one symbolic in the length
    _train(copy.deepcopy(initial), rank, world_size, [8, 12], regions)
    compiled = dict(counters["fsdp_graph"])
    # as a relaunch would: nothing compiled in this process is reused but the caches on disk; the
    # symbolic graph's program is stored with its output strides as expressions
    torch._dynamo.reset()
    counters.clear()
    _train(copy.deepcopy(initial), rank, world_size, [8, 12], regions)
    return {"compiled": compiled, "relaunch": {**counters["fsdp_graph"], **counters["aot_autograd"]}}


@pytest.mark.slow  # Inductor compiles cold and loads in a new launch
@pytest.mark.parametrize("regions", ["marked", "blocks"])
def test_pieces_train_as_the_unsharded_model_compile_repeated_blocks_once_and_load_from_the_cache(tmp_path, regions):
    """With regions="blocks" too, whose backward graph symbolic in the length makes zeros of a
    symbolic size: [Note: Symbolic fills that unpickle] in fsdp_graph/compile/partition.py."""
    result = run_ranks(_compile_then_load, 2, str(tmp_path / "inductor"), regions)
    count = result["compiled"]
    # each graph (forward and backward, static and symbolic) compiles its middle blocks' pieces once:
    # six blocks, at least three repeats per graph
    assert count["pieces"] - count["pieces_compiled"] >= 3 * 3, count
    # both graphs, the static and the symbolic one, come from AOTAutograd's cache, nothing cut again
    assert result["relaunch"].get("autograd_cache_hit", 0) == 2, result["relaunch"]
    assert result["relaunch"].get("pieces", 0) == 0, result["relaunch"]


def _step_of_distinct_pieces(x):
    # two ops a piece: a single op is no piece ([Note: Pieces too small to compile])
    for op in (torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid):
        x = funcol.all_reduce(op(x) + 1, "sum", torch.distributed.group.WORLD)
    return (x * 2 + 1,)


def test_each_local_rank_compiles_its_own_share_of_the_pieces_first(monkeypatch):
    # [Note: Each rank compiles its own share of the pieces first]: ranks of one node that take the
    # pieces in one order wait for each other's kernel builds; here each starts with a share of its
    # own, and every rank still compiles each piece (or loads it) and runs the same program
    with fake_process_group(2):
        gm = make_fx(_step_of_distinct_pieces, tracing_mode="fake")(torch.randn(4))
        orders, programs = [], []
        for local_rank in range(2):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
            order = []

            def compile_piece(graph, inputs):
                order.append(graph.code)
                return graph.code  # stands for the compiled piece: which code it came from

            programs.append(compile_pieces(gm, compile_piece).pieces)
            orders.append(order)
    assert len(orders[0]) == len(set(orders[0])) == 6 and set(orders[0]) == set(orders[1]), orders
    first_halves = [set(order[:3]) for order in orders]
    assert not first_halves[0] & first_halves[1], "both ranks started with the same pieces"
    assert programs[0] == programs[1] and set(programs[0]) == set(orders[0]), "the ranks' programs differ"
    assert "sin" in programs[0][0] and "mul" in programs[0][-1], "the program's pieces are not in the graph's order"


def _step_with_runs_of_one_kernel(x):
    x = funcol.all_reduce(x.sin() + 1, "sum", torch.distributed.group.WORLD)
    x = funcol.all_reduce(x.view(2, -1)[0] / 2, "sum", torch.distributed.group.WORLD)  # views and one div
    x = funcol.all_reduce(torch.rand_like(x), "sum", torch.distributed.group.WORLD)  # random: Inductor draws it
    return (x.cos() * 3,)


def _run_in_pieces(step):
    """`step` traced on one fake rank, cut into pieces that run as traced (uncompiled): the pieces'
    graphs, the ops the program runs itself, and the step's values from its graph and from the
    program (each from the same seed)."""
    with fake_process_group(1):
        gm = make_fx(step, tracing_mode="fake")(torch.randn(8))
        compiled = []

        def compile_piece(graph, inputs):
            compiled.append(graph)
            return lambda args: graph(*args)

        program = compile_pieces(gm, compile_piece)
        outside = [what for what, *_ in program.steps if not isinstance(what, int)]
        x = torch.randn(8)
        torch.manual_seed(0)
        expected = gm(x.clone())
        torch.manual_seed(0)
        got = program([x.clone()])
    return compiled, outside, expected, got


def test_a_run_of_one_kernel_is_run_by_the_program_not_compiled():
    # [Note: Pieces too small to compile]: the views and the division between the first and second
    # collectives are run op by op by the program; the rest are pieces. Against the graph run eagerly.
    compiled, outside, expected, got = _run_in_pieces(_step_with_runs_of_one_kernel)
    assert len(compiled) == 3, [g.code for g in compiled]
    assert torch.ops.aten.div.Tensor in outside and torch.ops.aten.select.int in outside, outside
    assert any(n.target is torch.ops.aten.rand_like.default for g in compiled for n in g.graph.nodes)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _blocks_that_make_the_next_collectives_buffer(x):
    # the same block twice; in the middle of each, the buffer of a collective that follows it, of a
    # different size in each block (as the gather of the next group is made in a layer's computation)
    results = []
    for size in (4, 6):
        y = x.sin() * 2
        buffer = torch.ones(size)
        x = funcol.all_reduce(y.cos() + 1, "sum", torch.distributed.group.WORLD)
        results.append(funcol.all_reduce(buffer, "sum", torch.distributed.group.WORLD))
    return (x * 3, *results)


def test_a_collectives_fresh_buffer_is_made_by_the_program_and_blocks_are_one_piece():
    # [Note: A collective's fresh buffer is no part of a piece]: both blocks are one piece, compiled
    # once, the buffers made by the program. Against the graph run eagerly.
    compiled, outside, expected, got = _run_in_pieces(_blocks_that_make_the_next_collectives_buffer)
    blocks = [g for g in compiled if any(n.target is torch.ops.aten.sin.default for n in g.graph.nodes)]
    assert len(blocks) == 1, [g.code for g in compiled]
    assert not any(n.target is torch.ops.aten.ones.default for g in compiled for n in g.graph.nodes)
    assert outside.count(torch.ops.aten.ones.default) == 2, outside
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _backward_that_reads_a_saved_value_on_both_sides_of_a_collective(saved, grad):
    doubled = funcol.all_reduce((saved * grad).exp(), "sum", torch.distributed.group.WORLD)
    return ((doubled + saved).exp(),)


def test_a_piece_leaves_the_backwards_donated_inputs_alone():
    # [Note: A piece donates none of its inputs]: AOTAutograd numbers the backward's donated inputs
    # (saved activations the backward may overwrite) among the step's inputs; a piece must not take
    # them for its own. Here the step's input 0 is donated, and the first piece's input 0 (`saved`)
    # is read again after the all-reduce. Against the same graph run eagerly.
    from torch._functorch._aot_autograd.schemas import ViewAndMutationMeta
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from fsdp_graph.compile.pieces import compile_in_pieces

    saved, grad = torch.randn(64), torch.randn(64)
    with fake_process_group(1):
        gm = make_fx(_backward_that_reads_a_saved_value_on_both_sides_of_a_collective, tracing_mode="fake")(saved, grad)
        (expected,) = gm(saved.clone(), grad.clone())
        fakes = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        context = TracingContext(detect_fake_mode(fakes))
        context.fw_metadata = ViewAndMutationMeta.__new__(ViewAndMutationMeta)  # only what a backward's compile reads
        context.fw_metadata.bw_donated_idxs = [0]
        with tracing(context):
            program = compile_in_pieces(lambda graph: None, gm, fakes, is_backward=True)
        assert context.fw_metadata.bw_donated_idxs == [0], "the step's donated inputs were not given back"
        (got,) = program([saved.clone(), grad.clone()])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def _a_view_with_gaps_across_a_collective(x):
    # a router's gates, one per token: a diagonal view (strides (16, 5)) of a softmax, read after
    # the all-reduce and returned (as a forward returns what its backward reads)
    gates = (x.view(8, 4) @ x.view(4, 8)[:, :4]).softmax(-1).view(2, 4, 4).diagonal(dim1=1, dim2=2)
    total = funcol.all_reduce(x.cos() + 1, "sum", torch.distributed.group.WORLD)
    return (gates * total.view(2, 4, 4).sum(-1)).exp(), gates


def test_a_view_with_gaps_crosses_from_piece_to_piece():
    # [Note: Values between pieces are dense]: Inductor returned the first piece's diagonal view dense,
    # and the second piece, compiled for the view's strides, refused it (`assert_size_stride`: the
    # test model of expert parallelism under Inductor). Against the graph run eagerly.
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.decomposition import select_decomp_table
    from fsdp_graph.compile.pieces import compile_in_pieces

    x = torch.randn(32)
    with fake_process_group(1):
        gm = make_fx(_a_view_with_gaps_across_a_collective, select_decomp_table(), tracing_mode="fake")(x)
        expected = gm(x.clone())
        fakes = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        with tracing(TracingContext(detect_fake_mode(fakes))):
            program = compile_in_pieces(lambda graph: None, gm, fakes)
        got = program([x.clone()])
    assert len(program.pieces) == 2
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def _all_to_all_with_splits_from_the_data(x, counts):
    # expert parallelism's dispatch: the splits read from a tensor (unbacked sizes u0, u1), defined
    # in the piece before the all-to-all and sizing the values of the piece after it
    splits = counts.tolist()
    y = funcol.all_to_all_single(x.sin() * 3, splits, splits, torch.distributed.group.WORLD)
    return ((y.cos() + 1) * y).sum(0)


def test_sizes_read_from_the_data_reach_the_pieces_that_use_them():
    # A piece whose values are sized by a number read in an earlier piece takes that number as an
    # input (Inductor failed: "For u0 + u1, expected [u1, u0] to have been codegen-ed", torchtitan's
    # MoE with `capture_scalar_outputs`). Against the function run eagerly on the same fake world.
    from fsdp_graph.predict import fake_world

    x, counts = torch.randn(6, 4), torch.tensor([2, 4])
    with fake_world(2), torch._dynamo.config.patch(capture_scalar_outputs=True):
        counters.clear()
        got = torch.compile(_all_to_all_with_splits_from_the_data, backend=fsdp_graph.backend())(x, counts)
        expected = _all_to_all_with_splits_from_the_data(x, counts)
        assert counters["fsdp_graph"]["pieces"] == 2, dict(counters["fsdp_graph"])
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # Inductor compiles cold
def test_a_piece_compiled_by_other_sources_is_not_loaded(tmp_path, monkeypatch):
    # A piece's FX-graph-cache key holds our sources' digest (how the piece is compiled is ours, and
    # Inductor's key does not hold everything we hand it): the same sources load it, others do not.
    import fsdp_graph.compile.pieces as pieces

    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # the FX graph cache keys a graph with its shape environment
    with fake_process_group(1):
        gm = make_fx(_backward_that_reads_a_saved_value_on_both_sides_of_a_collective)(
            *(fake_mode.from_tensor(torch.randn(64)) for _ in range(2)))
        fakes = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
        lookups = []
        for digest in ("a" * 64, "a" * 64, "b" * 64):
            monkeypatch.setattr(pieces, "own_sources_digest", lambda: digest)
            counters.clear()
            with tracing(TracingContext(fake_mode)):
                pieces.compile_in_pieces(lambda graph: None, copy.deepcopy(gm), fakes)
            lookups.append((counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]))
    assert lookups[0] == (0, 2) and lookups[1] == (2, 0) and lookups[2] == (0, 2), lookups
