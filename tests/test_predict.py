"""fsdp_graph.predict: capturing a step at a world size and on parameters this process never holds.

The reference is arithmetic on the unsharded model's parameter shapes: what each group's forward
all-gather must carry at world size 64 (padded rows plus one gradient flag per trainable parameter
per rank, an even number of them, see [Note: Gradient flags in a graph] in traced/unshard.py and
[Note: An even number of flag columns] in runtime/bucket_layout.py), and one reduce-scatter per
group in backward.
"""

import math

import pytest
import torch
import torch.distributed as dist

from _models import MLPStack, shard_blocks_then_root
from fsdp_graph import MixedPrecisionPolicy, fully_shard
from fsdp_graph.passes.nodes import fsdp_meta, is_all_gather, is_reduce_scatter, tensor_bytes
from fsdp_graph.predict import capture_graphs, fake_world, schedule_graphs
from fsdp_graph.runtime.meta import GROUP_KEY

WORLD = 64


def _expected_gather_bytes(params: list) -> int:
    flags = len(params) + len(params) % 2
    per_rank = sum(math.ceil(p.shape[0] / WORLD) * math.prod(p.shape[1:]) for p in params) + flags
    return WORLD * per_rank * 4  # fp32


def test_capture_on_meta_at_world_size_64():
    with torch.device("meta"):
        model = MLPStack()
    groups = {f"blocks.{i}": list(block.parameters()) for i, block in enumerate(model.blocks)}
    groups["<root>"] = [*model.inp.parameters(), *model.head.parameters()]
    with fake_world(WORLD):
        shard_blocks_then_root(model)
        graphs = capture_graphs(model, torch.randn(4, 13, device="meta"))
    gathered = {fsdp_meta(n, GROUP_KEY): tensor_bytes(n) for n in graphs["forward"].graph.nodes if is_all_gather(n)}
    assert gathered == {group: _expected_gather_bytes(params) for group, params in groups.items()}
    reduced = [fsdp_meta(n, GROUP_KEY) for n in graphs["backward"].graph.nodes if is_reduce_scatter(n)]
    assert sorted(reduced) == sorted(groups)
    assert not dist.is_initialized()  # fake_world cleaned up


def test_fake_world_refuses_a_second_process_group():
    with fake_world(2):
        with pytest.raises(ValueError, match="destroy_process_group"):
            with fake_world(4):
                pass


# -- flash attention on meta: `LlamaConfig.flash_attention` in examples/llama.py says why, `_MetaRunner` in
# fsdp_graph/predict.py how a captured graph runs its RNG-state wrappers on meta ---------------------------

BATCH, SEQ, HEADS, KV_HEADS, DIM, LAYERS = 2, 32, 4, 2, 64, 2


def _capture_llama(flash_attention: bool, world: int = 4) -> dict:
    from _models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      hidden_dim=96, max_seq_len=SEQ, checkpoint_blocks=True, flash_attention=flash_attention)
    with torch.device("meta"):
        model = Llama(cfg)
    with fake_world(world):
        shard_blocks_then_root(model)
        return capture_graphs(model, torch.randint(0, 64, (BATCH, SEQ), device="meta"))


def _flops(graphs: dict) -> int:
    from fsdp_graph.passes.cost_model import op_facts

    return sum(op_facts(n).flops for gm in graphs.values() for n in gm.graph.nodes)


def _holds_scores(graphs: dict) -> bool:
    """Any tensor shaped like attention scores, [batch, heads, seq, seq] (or their [batch*heads, seq, seq] view)?"""
    shapes = {(BATCH, HEADS, SEQ, SEQ), (BATCH * HEADS, SEQ, SEQ)}
    vals = [n.meta.get("val") for gm in graphs.values() for n in gm.graph.nodes]
    # (the RNG states' fake tensors have a symbolic size; nothing else does)
    return any(isinstance(v, torch.Tensor) and all(type(d) is int for d in v.shape) and tuple(v.shape) in shapes
               for v in vals)


def test_flash_attention_trace_holds_no_scores_and_counts_the_same_matmuls():
    """Checkpointed blocks, so the flash op is also recomputed (inside the partitioner's RNG-state
    wrappers). The math path's FLOPs are its batched matmuls (torch's bmm formula): per block, the
    forward's QK^T and PV twice (forward, recompute) and four in backward. Flash attention's backward
    also recomputes QK^T: one bmm more per block, 2 * b * h * s * s * d."""
    math, flash = _capture_llama(False), _capture_llama(True)
    assert _holds_scores(math) and not _holds_scores(flash)
    head_dim = DIM // HEADS
    assert _flops(flash) - _flops(math) == LAYERS * 2 * BATCH * HEADS * SEQ * SEQ * head_dim
    targets = {str(n.target) for gm in flash.values() for n in gm.graph.nodes}
    assert "run_and_save_rng_state" in targets and "run_with_rng_state" in targets  # the wrapped recompute


def test_flash_attention_is_off_for_real_tensors():
    """The default keeps F.scaled_dot_product_attention, so CPU training keeps its numbers."""
    from _models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(dim=DIM, num_layers=1, num_heads=HEADS, num_kv_heads=KV_HEADS, hidden_dim=96, max_seq_len=SEQ)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    attention = model.layers[0].attention
    x = model.layers[0].attention_norm(model.tok_embeddings(tokens))
    cos, sin = model.rope_cos[:SEQ, None, :], model.rope_sin[:SEQ, None, :]
    q = torch.nn.functional.linear(x, attention.wq.weight).view(BATCH, SEQ, HEADS, -1)
    k = torch.nn.functional.linear(x, attention.wk.weight).view(BATCH, SEQ, KV_HEADS, -1)
    v = torch.nn.functional.linear(x, attention.wv.weight).view(BATCH, SEQ, KV_HEADS, -1)
    from llama import _rotate

    q, k, v = _rotate(q, cos, sin).transpose(1, 2), _rotate(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5).masked_fill(~mask, float("-inf"))
    expected = attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(BATCH, SEQ, -1))
    torch.testing.assert_close(attention(x, cos, sin), expected)


# -- overlap_tp_all_reduces (passes/tp_overlap.py) ------------------------------------------------------


def _schedule(graphs: dict, disabled: frozenset) -> dict:
    from fsdp_graph.passes.cost_model import CostModel

    cost_model = CostModel("h100-infiniband", links={"tp": "h100-nvlink"})
    return schedule_graphs(graphs, hardware_profile=cost_model, disabled_passes=disabled, async_tp_chunks=4)


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_overlap_tp_all_reduces_moves_only_independent_work_and_hides_tp_time():
    """FSDP 2 x TP 2 on meta, a Llama with checkpointed blocks as the 70B prediction builds it: the
    pass keeps every node, every node after its inputs, the order of each stream's collectives, and
    it moves work under the backward's TP all-reduces (the simulator, with a fixed cost model, sees
    less exposed TP time and no more exposed FSDP time)."""
    from benchmark_tp import parallelize_llama
    from fsdp_graph.passes.cost_model import CostModel
    from fsdp_graph.passes.nodes import PASS_META, is_collective, parallelism_of
    from fsdp_graph.passes.simulator import simulate
    from _models import Llama, LlamaConfig
    from torch.distributed.device_mesh import init_device_mesh

    cfg = LlamaConfig(vocab_size=512, dim=256, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=512,
                      max_seq_len=256, checkpoint_blocks=True, flash_attention=True)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Llama(cfg)
        parallelize_llama(model, mesh, fully_shard, vocab_parallel=True)
        graphs = capture_graphs(model, torch.randint(0, 512, (2, 256), device="meta"))
        without = _schedule(graphs, frozenset({"overlap_tp_all_reduces"}))["backward"]
        with_pass = _schedule(graphs, frozenset())["backward"]
        cost_model = CostModel("h100-infiniband", links={"tp": "h100-nvlink"})
        sims = {name: simulate(gm, cost_model) for name, gm in (("without", without), ("with", with_pass))}
    order = list(with_pass.graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    assert sorted(n.name for n in order) == sorted(n.name for n in without.graph.nodes)
    assert all(position[a] < position[n] for n in order for a in n.all_input_nodes)
    for stream in ("fsdp", "tp"):
        issued = [[n.name for n in gm.graph.nodes if is_collective(n) and parallelism_of(n) == stream]
                  for gm in (without, with_pass)]
        assert issued[0] == issued[1], stream
    assert any(n.meta.get(PASS_META) == "overlap_tp_all_reduces" for n in order)

    def exposed(sim, stream):
        return sum(c.exposed_s for c in sim.collectives if c.parallelism == stream)

    assert exposed(sims["with"], "tp") < exposed(sims["without"], "tp")
    assert exposed(sims["with"], "fsdp") <= exposed(sims["without"], "fsdp") + 1e-9


# -- stamping blocks out (passes/stamp.py) ----------------------------------------------------------------
# The reference is the trace of the whole model: the graphs stamped out from four traced blocks hold the
# same ops, the same FSDP collectives per group, and predict the same step to the last bit.


def _ops(gm) -> list:
    """The graph's ops, by kind, and each FSDP group's annotated nodes in order."""
    from collections import Counter

    ops = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    per_group = {}
    for n in gm.graph.nodes:
        group = fsdp_meta(n, GROUP_KEY)
        if group is not None:
            per_group.setdefault(group, []).append(str(n.target))
    return [sorted(ops.items()), per_group]


def _prediction(graphs: dict, scheduled: bool) -> tuple:
    from fsdp_graph.passes.cost_model import CostModel
    from fsdp_graph.predict import predict_step

    cost_model = CostModel("h100-infiniband", links={"tp": "h100-nvlink"})
    if scheduled:
        graphs = schedule_graphs(graphs, hardware_profile=cost_model, async_tp_chunks=4)
    step = predict_step(graphs, cost_model)
    return step.step_s, step.exposed_s, step.peak_bytes, step.peak_graph, step.num_collectives


def _llama_tp(layers: int):
    from benchmark_tp import parallelize_llama
    from _models import Llama, LlamaConfig
    from torch.distributed.device_mesh import init_device_mesh

    cfg = LlamaConfig(vocab_size=256, dim=128, num_layers=layers, num_heads=4, num_kv_heads=2, hidden_dim=256,
                      max_seq_len=64, checkpoint_blocks=True, flash_attention=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Llama(cfg)
    parallelize_llama(model, mesh, fully_shard, vocab_parallel=True)
    return model, model.layers, (torch.randint(0, 256, (2, 64), device="meta"),)


def _mlp_stack(layers: int):
    with torch.device("meta"):
        model = MLPStack(dim=24, hidden=40, num_blocks=layers)
    shard_blocks_then_root(model)
    return model, model.blocks, (torch.randn(8, 24, device="meta"),)


def _moe_fsdp_x_ep(layers: int):
    """examples/predict_moe.py's model, small: layers whose routed experts shard over another mesh
    than the rest (two groups per layer), all-to-alls in every layer, checkpointed."""
    import predict_moe
    from torch.distributed.device_mesh import init_device_mesh

    config = predict_moe.Config()
    config.dim, config.heads, config.kv_heads, config.head_dim = 64, 4, 2, 16
    config.experts, config.top_k, config.expert_hidden, config.vocab = 8, 2, 32, 128
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
    with torch.device("meta"):
        model = predict_moe.Model(config, layers, sparse["ep"])
    predict_moe.shard(model, world, sparse["efsdp"], sparse["ep"], MixedPrecisionPolicy())
    return model, model.layers, (torch.randint(0, 128, (2, 32), device="meta"),)


@pytest.mark.parametrize("build, world, budget", [pytest.param(_llama_tp, 4, None, marks=pytest.mark.slow), (_mlp_stack, 8, None),
                                                  (_mlp_stack, 8, 60_000), pytest.param(_moe_fsdp_x_ep, 4, None, marks=pytest.mark.slow)],
                         ids=["llama-fsdp-x-tp-checkpointed", "mlp-stack", "mlp-stack-memory-budget", "moe-fsdp-x-ep"])
def test_stamped_graphs_are_the_whole_models_trace(build, world, budget):
    with fake_world(world):
        model, _, inputs = build(7)
        whole = capture_graphs(model, *inputs, memory_budget_bytes=budget)
        model, blocks, inputs = build(7)
        before = list(blocks)
        stamped = capture_graphs(model, *inputs, memory_budget_bytes=budget, repeated_blocks=blocks)
        assert list(blocks) == before  # the model's list is as it was
        for kind in ("forward", "backward"):
            assert _ops(stamped[kind]) == _ops(whole[kind]), kind
        for scheduled in (False, True):
            assert _prediction(stamped, scheduled) == _prediction(whole, scheduled)


def test_stamping_refuses_blocks_that_differ():
    """A list whose middle block is wider than its neighbours, and one whose blocks are not groups of their
    own: a ValueError that says to capture the whole model, or to shard each block."""
    with fake_world(8):
        with torch.device("meta"):
            model = MLPStack(dim=24, hidden=40, num_blocks=6)
            model.blocks[2] = type(model.blocks[2])(24, 48)
        shard_blocks_then_root(model)
        with pytest.raises(ValueError, match="capture the whole model"):
            capture_graphs(model, torch.randn(8, 24, device="meta"), repeated_blocks=model.blocks)
        assert len(model.blocks) == 6
        with torch.device("meta"):
            model = MLPStack(dim=24, hidden=40, num_blocks=6)
        fully_shard(model)
        with pytest.raises(ValueError, match="fully_shard group of its own"):
            capture_graphs(model, torch.randn(8, 24, device="meta"), repeated_blocks=model.blocks)
