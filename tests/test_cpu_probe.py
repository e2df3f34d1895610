"""Inductor's CPU probe runs in the background while our backend traces and schedules the step, or
loads it from the caches ([Note: The CPU probe in the background] in fsdp_graph/compile/cpu_probe.py),
and the compiled step trains as the unsharded model does (2 gloo ranks, Inductor)."""

import os

import copy
import threading
import time

import pytest
import torch

import fsdp_graph
from _harness import run_ranks
from _models import MLPStack, batch_for_step, check_grads_match, loss_fn, shard_blocks_then_root
from fsdp_graph.compile import cpu_probe


def _train_and_name_the_prober(rank, world_size, compiler, cache_dir=None):
    from torch._inductor import cpu_vec_isa

    if cache_dir is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    askers = []
    asked = cpu_vec_isa.valid_vec_isa_list  # what `pick_vec_isa` calls, cached by torch

    def recorded():
        # Who asked, in order; the probe answers after a second (this process's fork server
        # probed already, so its answer is cached: the second stands for the real probe's builds).
        asker = threading.current_thread().name
        askers.append(asker)
        if asker == "fsdp_graph-cpu-probe":
            time.sleep(1)
            askers.append("answered")
        return asked()

    cpu_vec_isa.valid_vec_isa_list = recorded
    cpu_probe._probe = None  # a rank forked from a process that compiled before starts its own probe
    try:
        torch.manual_seed(0)
        reference = MLPStack()
        model = copy.deepcopy(reference)
        shard_blocks_then_root(model)
        compiled = torch.compile(model, backend=fsdp_graph.backend(compiler=compiler))
        for step in range(2):
            x, y, lx, ly = batch_for_step(reference, step, 8, rank, world_size)
            loss_fn(reference, reference(x), y).backward()
            loss_fn(model, compiled(lx), ly).backward()
            check_grads_match(model, reference)
            for net in (model, reference):
                net.zero_grad()
    finally:
        cpu_vec_isa.valid_vec_isa_list = asked
        torch._dynamo.reset()
    return askers


@pytest.mark.slow  # over 7 s on a 2-core machine (docs/testing.md)
def test_inductor_finds_the_cpu_probed_in_the_background(tmp_path):
    """A cold compile, then a relaunch that loads the step from the caches: in neither does the main
    thread ask before the probe has answered."""
    for launch in ("cold", "relaunch"):
        askers = run_ranks(_train_and_name_the_prober, 2, "inductor", str(tmp_path / "inductor"))
        assert askers[:2] == ["fsdp_graph-cpu-probe", "answered"], (launch, askers)


def test_no_probe_without_inductor():
    assert run_ranks(_train_and_name_the_prober, 2, "aot_eager") == []
