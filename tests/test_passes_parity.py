"""Every scheduling pass on and off gives the same losses and gradients (2 gloo ranks).

`train_compiled_and_compare` checks each compiled run against an unsharded reference and,
bit for bit (aot_eager runs the same ops), against the eager runtime; here all runs must also give
identical losses. The options force every pass to act: a latency-bound profile makes auto-bucketing
merge, a small cap makes it split, and no limits let the reorder prefetch and sink waits.
"""

import pytest
import torch

import fsdp_graph
from _compile_helpers import train_compiled_and_compare
from _harness import run_ranks
from _models import MLPStack, shard_blocks_then_root
from fsdp_graph.inspect.timeline import load_programs
from fsdp_graph.passes.cost_model import CollectiveKind, HardwareProfile
from fsdp_graph.passes.simulator import OpKind



def shard_mlp(model):
    shard_blocks_then_root(model)
    return model


_LATENCY_BOUND = HardwareProfile("latency-bound", 1e9, 1e9, 1e9, 0.0, 1e-3, 1e15)


def _run(rank, world_size, dump_dir):
    results = {}
    configs = {
        "all on, merging": dict(hardware_profile=_LATENCY_BOUND),
        "all on, splitting": dict(hardware_profile="cpu-gloo", bucket_cap_bytes=64, dump_dir=f"{dump_dir}/rank{rank}"),
        "bucket_by_group off": dict(hardware_profile=_LATENCY_BOUND, disabled_passes={"bucket_by_group"}),
        "auto_bucket off": dict(hardware_profile=_LATENCY_BOUND, disabled_passes={"auto_bucket"}),
        "reorder_for_overlap off": dict(hardware_profile=_LATENCY_BOUND, disabled_passes={"reorder_for_overlap"}),
        "all off": dict(disabled_passes={"bucket_by_group", "auto_bucket", "reorder_for_overlap"}),
    }
    for name, options in configs.items():
        torch.manual_seed(0)
        torch._dynamo.reset()
        results[name] = train_compiled_and_compare(
            MLPStack(), shard_mlp, fsdp_graph.backend(compiler="aot_eager", **options), rank, world_size
        )["losses"]
    programs = load_programs(f"{dump_dir}/rank{rank}")
    split = {label: sum(op.kind is OpKind.COLLECTIVE for op in program) for label, program in programs.items()}
    gathers = {op.target for p in programs.values() for op in p if op.facts.collective is CollectiveKind.ALL_GATHER}
    return results, split, gathers


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_each_scheduling_pass_on_and_off_gives_identical_training(tmp_path):
    losses, split, gathers = run_ranks(_run, 2, str(tmp_path))
    for name, values in losses.items():
        assert values == losses["all off"], f"{name}: {values} != {losses['all off']}"
    assert min(split.values()) > 9, split  # MLPStack: 5 groups, split into many more pieces
    assert gathers == {"all_gather_into_tensor_out"}, gathers  # [Note: All-gathers on gloo] in passes/gloo.py


def _calibrate(rank, world_size):
    from fsdp_graph.passes.cost_model import calibrate

    import torch.distributed as dist

    profile = calibrate()
    numbers = (profile.collective_latency_s, profile.bus_bytes_per_s, profile.fp32_matmul_flops_per_s)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, numbers)
    assert all(n == numbers for n in everyone), everyone
    return numbers


def test_calibration_gives_the_same_profile_on_every_rank():
    latency, bus, flops = run_ranks(_calibrate, 2)
    assert latency >= 0 and bus > 0 and flops > 0
