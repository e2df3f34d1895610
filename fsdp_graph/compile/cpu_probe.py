"""Inductor's one-time probe of the CPU's vector instructions, started while the step is traced.

[Note: The CPU probe in the background]
Before Inductor writes its first C++ kernel in a process it asks which vector instruction sets the
CPU and compiler support (`torch._inductor.cpu_vec_isa.pick_vec_isa`): for each candidate the CPU
reports (AMX, AVX-512 VNNI, AVX-512, AVX2 on a recent x86) it builds a small test library with g++
and loads it in a child Python, one candidate after the other: seconds of g++ with an empty
Inductor cache, child processes with a warm one (docs/graph_trainer_runs.md, "Quiet again", has the
figures).
torch pays it in the main thread when the first kernel is compiled, after the step has been traced
and partitioned.

Our backend knows that Inductor will ask as soon as Dynamo hands it a graph on the CPU, before the
ranks agree on the frame, trace the joint graph and partition it. So the probe starts then, in
threads of its own that spend their time waiting on g++ and on the children, not holding the GIL:
one per x86 candidate at once (the ranks of a machine share the builds, each candidate's behind one
of Inductor's file locks), then `pick_vec_isa` itself, which finds every candidate's answer in
torch's own cache. Our inner compiler waits for it before Inductor compiles, and a step of pieces
loaded from the caches on a relaunch waits before it loads its kernels (loading a C++ kernel asks
too), so the main thread does not probe a second time beside it. The answers are torch's, computed
by torch's code, so the kernels are what they would be without us. Nothing starts for
`compiler="aot_eager"`, for graphs on CUDA, or after the first probe of the process. A probe that
raises is only logged: Inductor then asks again in the main thread and raises, or answers, as it
would have. examples/benchmark_graph_trainer.py measures the cold start with it.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Sequence

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_probe: Optional[threading.Thread] = None


def _x86_candidates() -> list:
    """The vector ISAs `valid_vec_isa_list` builds a test for on this x86 CPU (none elsewhere)."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()  # empty off x86
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _probe_all() -> None:
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    try:
        builds = [threading.Thread(target=bool, args=(isa,), name=f"fsdp_graph-cpu-probe-{isa}", daemon=True)
                  for isa in _x86_candidates()]  # `bool(isa)` builds and loads its test, cached by torch
        for build in builds:
            build.start()
        for build in builds:
            build.join()
        pick_vec_isa()
    except Exception as error:  # Inductor asks again in the main thread; see the Note
        logger.debug("fsdp_graph: the background CPU probe failed (%s: %s)", type(error).__name__, error)


def start_cpu_probe(example_inputs: Sequence[object]) -> None:
    """Start Inductor's CPU probe in the background, if the graph runs on the CPU and no probe has."""
    global _probe
    if not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in example_inputs):
        return
    with _lock:
        if _probe is None:
            _probe = threading.Thread(target=_probe_all, name="fsdp_graph-cpu-probe", daemon=True)
            _probe.start()


def wait_for_cpu_probe() -> None:
    """Wait for the probe `start_cpu_probe` started, if any (at once when it has finished)."""
    with _lock:
        probe = _probe
    if probe is not None:
        probe.join()
