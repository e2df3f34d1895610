"""`activation_checkpointing="save_matmuls"` (passes/checkpoint_policy.py): activations chosen on
the joint graph, each block's matmul and attention outputs saved and the rest recomputed in
backward. On a fake world, what the graphs save and recompute against the same model without the
policy; on 2 gloo ranks, training against the unsharded model and the eager runtime."""

import tempfile

import pytest
import torch

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import Block, Llama, LlamaConfig, shard_blocks_then_root, shard_llama, tiny_llama
from fsdp_graph import fully_shard
from fsdp_graph.passes.cost_model import CostModel
from fsdp_graph.passes.nodes import is_region_call, region_body, tensor_bytes
from fsdp_graph.predict import capture_graphs, fake_world, predict_step, schedule_graphs

aten = torch.ops.aten


class _RegionBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


def _captured(policy, regions=False):
    """`regions`: every block a compile region ([Note: Blocks as compile regions]), whose body the
    partitioner splits on its own."""
    cfg = LlamaConfig(vocab_size=256, dim=128, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=384,
                      max_seq_len=128, flash_attention=True)
    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.layers if regions else ():
        block.__class__ = _RegionBlock
    with fake_world(4):
        shard_blocks_then_root(model)
        graphs = capture_graphs(model, torch.randint(0, 256, (2, 128), device="meta"), activation_checkpointing=policy)
        cost_model = CostModel("h100-infiniband")
        return graphs, predict_step(schedule_graphs(graphs, hardware_profile=cost_model), cost_model)


def _count(gm, *targets):
    """Nodes calling `targets` in `gm` and in the bodies of its compile regions' calls (each body
    once, as the step runs it once per call)."""
    return sum(_count(region_body(node), *targets) if is_region_call(node) else node.target in targets
               for node in gm.graph.nodes)


@pytest.mark.parametrize("regions", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["inline", "regions"])
def test_each_block_saves_its_matmuls_and_recomputes_the_rest(regions):
    """With the policy the forward hands the backward fewer bytes and the backward recomputes the
    norms, never a matmul nor attention (a compile region's call neither: its body follows the
    policy); the predicted peak drops."""
    (plain, plain_step), (policy, policy_step) = _captured(None, regions), _captured("save_matmuls", regions)

    def saved_bytes(graphs):
        output = next(n for n in graphs["forward"].graph.nodes if n.op == "output")
        return sum(tensor_bytes(n) for n in output.all_input_nodes)

    assert saved_bytes(policy) < 0.8 * saved_bytes(plain), (saved_bytes(policy), saved_bytes(plain))
    assert _count(plain["backward"], aten.rsqrt.default) == 0  # the partitioner saved the norms' statistics
    assert _count(policy["backward"], aten.rsqrt.default) == 3 * 2  # each block's two norms, recomputed
    costly = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert _count(policy["backward"], *costly) == _count(plain["backward"], *costly)
    assert _count(policy["forward"], *costly) == _count(plain["forward"], *costly)
    assert policy_step.peak_bytes < plain_step.peak_bytes, (policy_step.peak_bytes, plain_step.peak_bytes)


def _policy_trains(rank, world_size, regions):
    torch.manual_seed(0)
    model = tiny_llama()
    for block in model.layers if regions else ():
        block.__class__ = _RegionBlock
    with tempfile.TemporaryDirectory() as tmp:
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=tmp, activation_checkpointing="save_matmuls")
        return train_compiled_and_compare(model, lambda m: shard_llama(m, fully_shard), backend, rank, world_size)


@pytest.mark.parametrize("regions", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["inline", "regions"])
def test_the_policy_trains_as_the_unsharded_model_and_the_eager_runtime(regions):
    """Recomputing gives the forward's numbers again: bit for bit with the eager runtime, within
    rounding of the unsharded model, no group on the eager hooks."""
    result = run_ranks(_policy_trains, 2, regions)
    assert not result["fallbacks"], result["fallbacks"]
    assert result["max_rel_diff_vs_reference"] < 1e-5


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="activation_checkpointing must be None or one of"):
        fsdp_graph.backend(activation_checkpointing="everything")
