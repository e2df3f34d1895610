"""Compiled training (`backend="fsdp_graph"`) matches an unsharded model and the eager runtime.

Two gloo ranks. `aot_eager` runs the same ops as the eager runtime in the same order, so its losses,
gradient shards and parameters must equal the eager runtime's bit for bit; Inductor fuses and
reorders arithmetic, so it is held to 1e-5 relative.
"""

import pytest
import torch

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import MLPStack, shard_blocks_then_root, shard_llama, tiny_llama
from fsdp_graph import fully_shard
from fsdp_graph.passes.cost_model import CollectiveKind
from fsdp_graph.passes.simulator import OpKind, all_gathers_in_flight, in_flight
from fsdp_graph.inspect.timeline import load_programs


def _shard_mlp(model, **kwargs):
    shard_blocks_then_root(model, **kwargs)
    return model


def _mlp(rank, world_size, compiler, reshard_after_forward):
    torch.manual_seed(0)
    return train_compiled_and_compare(
        MLPStack(),
        lambda m: _shard_mlp(m, reshard_after_forward=reshard_after_forward),
        fsdp_graph.backend(compiler=compiler),
        rank,
        world_size,
        bitwise=compiler == "aot_eager",
    )


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_aot_eager_equals_eager_runtime_bitwise(reshard_after_forward):
    run_ranks(_mlp, 2, "aot_eager", reshard_after_forward)


def _llama(rank, world_size):
    torch.manual_seed(0)
    return train_compiled_and_compare(
        tiny_llama(), lambda m: shard_llama(m, fully_shard), fsdp_graph.backend(compiler="aot_eager"),
        rank, world_size,
    )


def test_transformer_aot_eager_equals_eager_runtime_bitwise():
    run_ranks(_llama, 2)


def _llama_in_flight(rank, world_size, dump_dir):
    torch.manual_seed(0)
    # auto_bucket off: each group keeps its own all-gather and reduce-scatter (forward: 3
    # all-gathers; backward: 2 re-gathers, 3 reduce-scatters), which prefetch would overlap. The
    # checks raise if any buffer of an in-flight collective is written, freed or resized.
    backend = fsdp_graph.backend(
        compiler="aot_eager", disabled_passes={"auto_bucket"}, dump_dir=f"{dump_dir}/rank{rank}", check_collectives=True
    )
    result = train_compiled_and_compare(tiny_llama(), lambda m: shard_llama(m, fully_shard), backend, rank, world_size)
    programs = load_programs(f"{dump_dir}/rank{rank}")
    result["in_flight"] = {label: in_flight(program)[1] for label, program in programs.items()}
    result["all_gathers_in_flight"] = {label: all_gathers_in_flight(program) for label, program in programs.items()}
    result["all_gather_targets"] = {
        op.target for p in programs.values() for op in p if op.facts.collective is CollectiveKind.ALL_GATHER
    }
    result["collectives"] = {label: sum(op.kind is OpKind.COLLECTIVE for op in p) for label, p in programs.items()}
    return result


def test_gloo_gathers_through_the_plain_allgather_with_several_in_flight(tmp_path):
    """[Note: All-gathers on gloo] in passes/gloo.py: on gloo every all-gather of a scheduled graph is
    `all_gather_into_tensor_out` (gloo's plain allgather), several collectives are in flight, no
    buffer is touched before its wait ([Note: Checking in-flight collectives]), and training matches
    the references."""
    result = run_ranks(_llama_in_flight, 2, str(tmp_path))
    assert sorted(result["collectives"].values()) == [3, 5], result["collectives"]
    assert result["all_gather_targets"] == {"all_gather_into_tensor_out"}, result["all_gather_targets"]
    assert max(result["all_gathers_in_flight"].values()) >= 2, result["all_gathers_in_flight"]
    assert max(result["in_flight"].values()) >= 2, result["in_flight"]


@pytest.mark.slow  # Inductor compiles cold
def test_inductor_matches_unsharded_reference():
    # Default resharding: blocks reshard after forward (re-gathered in backward), the root does not.
    result = run_ranks(_mlp, 2, "inductor", None)
    assert result["max_rel_diff_vs_reference"] <= 1e-5


def _hsdp(rank, world_size):
    # Replicate over both ranks, shard over one: the gradient all-reduce over the replicate axis
    # runs inside the backward graph.
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1))
    torch.manual_seed(0)
    return train_compiled_and_compare(
        MLPStack(), lambda m: _shard_mlp(m, mesh=mesh), fsdp_graph.backend(compiler="aot_eager"), rank, world_size
    )


def test_hsdp_aot_eager_equals_eager_runtime_bitwise():
    run_ranks(_hsdp, 2)
