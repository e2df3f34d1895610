"""FSDP2 features under `backend="fsdp_graph"` (aot_eager): each trains like an unsharded model and
like the eager runtime, on 2 gloo ranks. The eager halves of these features are in test_features.py,
test_runtime_wrapping.py and test_runtime_fsdp2_parity.py."""

import copy
import tempfile

import pytest
import torch

import fsdp_graph
from _compile_helpers import collective_groups, dumped_graphs, train_compiled_and_compare
from _harness import run_ranks
from _models import MLPStack, batch_for_step, loss_fn, shard_llama, tiny_llama
from fsdp_graph import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from test_features import CheckpointedLlama, _deterministic_init, _wrapped_blocks, meta_sharded_mlp


def _model(name):
    torch.manual_seed(0)
    if name == "frozen":
        model = MLPStack()
        for block in model.blocks:
            block.up.weight.requires_grad_(False)
        model.inp.requires_grad_(False)
        return model
    model = tiny_llama()
    if name in ("tied_list", "tied_root"):
        model.output.weight = model.tok_embeddings.weight
    elif name == "meta_init":
        model = MLPStack()
        _deterministic_init(model)
    return model


def _shard(name):
    def shard(m):
        if name == "frozen" or name == "meta_init":
            for block in m.blocks:
                fully_shard(block)
            return fully_shard(m)
        if name == "tied_list":
            for layer in m.layers:
                fully_shard(layer)
            fully_shard([m.tok_embeddings, m.output])
            return fully_shard(m)
        if name == "offload":
            return shard_llama(m, fully_shard, offload_policy=CPUOffloadPolicy())
        return shard_llama(m, fully_shard)
    return shard


def _feature(rank, world_size, name):
    shard = meta_sharded_mlp if name == "meta_init" else _shard(name)
    result = train_compiled_and_compare(
        _model(name), shard, fsdp_graph.backend(compiler="aot_eager"), rank, world_size
    )
    return result["fallbacks"]


@pytest.mark.parametrize("name", ["frozen", "tied_list", "tied_root", "offload", "meta_init"])
def test_feature_compiled_matches_eager_and_unsharded(name):
    fallbacks = run_ranks(_feature, 2, name)
    assert fallbacks == {}, fallbacks  # every group traced into the graph


def _mixed_precision(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    eager = shard_llama(copy.deepcopy(model), fully_shard, mp_policy=mp)
    traced = shard_llama(copy.deepcopy(model), fully_shard, mp_policy=mp)
    compiled = torch.compile(traced, backend=fsdp_graph.backend(compiler="aot_eager"))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, traced)]
    for step in range(2):
        _, _, x, y = batch_for_step(model, step, 8, rank, world_size)
        eager_loss = loss_fn(eager, eager(x).float(), y)
        eager_loss.backward()
        loss = loss_fn(traced, compiled(x).float(), y)
        loss.backward()
        # The same casts in the same order as the eager runtime (which matches torch's FSDP2 with
        # the same policy, test_runtime_fsdp2_parity): bit for bit.
        assert torch.equal(loss, eager_loss), (loss, eager_loss)
        eager_params = dict(eager.named_parameters())
        for name, p in traced.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad.to_local(), eager_params[name].grad.to_local()), name
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return dict(traced._fsdp_state.ctx.fallbacks)


def test_bf16_mixed_precision_compiled_equals_eager():
    assert run_ranks(_mixed_precision, 2) == {}


def _activation_checkpointing(rank, world_size, how):
    torch.manual_seed(0)
    model = tiny_llama()
    if how == "checkpoint":
        model.__class__ = CheckpointedLlama  # checkpoint(layer, ...) around each sharded block
    else:
        model = _wrapped_blocks(model)  # checkpoint_wrapper, then fully_shard on the wrapper
    with tempfile.TemporaryDirectory() as tmp:
        backend = fsdp_graph.backend(compiler="aot_eager", dump_dir=tmp)
        result = train_compiled_and_compare(model, lambda m: shard_llama(m, fully_shard), backend, rank, world_size)
        graphs = dumped_graphs(tmp)

    def ops(kind, op):
        return collective_groups(graphs, kind, op)

    return {
        "fallbacks": result["fallbacks"],
        "forward_gathers": ops("forward", "all_gather_into_tensor"),
        "backward_gathers": ops("backward", "all_gather_into_tensor"),
        "backward_reductions": ops("backward", "reduce_scatter_tensor"),
        "saved_unsharded": sorted({s["group"] for s in graphs["forward"]["saved_unsharded"]}),
    }


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_activation_checkpointing_compiled(how):
    """Parity with the unsharded model and bitwise with the eager runtime; one graph; and the
    recomputed blocks gather once each in backward, exactly as without checkpointing."""
    got = run_ranks(_activation_checkpointing, 2, how)
    assert got == {
        "fallbacks": {},
        "forward_gathers": ["<root>", "layers.0", "layers.1"],
        "backward_gathers": ["layers.1", "layers.0"],
        "backward_reductions": ["layers.1", "layers.0", "<root>"],
        "saved_unsharded": ["<root>"],  # the root keeps its parameters (reshard_after_forward=False)
    }, got


def test_grad_scaler_compiled():
    from test_features import grad_scaler_run

    scales = run_ranks(grad_scaler_run, 2, True)
    assert [s for s, _ in scales] == [s for _, s in scales] == [2.0**16, 2.0**15, 2.0**15, 2.0**16], scales
