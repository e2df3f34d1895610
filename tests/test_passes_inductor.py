"""Inductor keeps the schedule: the order of collectives in its generated code (fake 8-rank group)."""

import re

import torch
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from _harness import fake_process_group
from _schedule_helpers import FIXED, sharded_stack


def _calls(code: str) -> list[str]:
    """`AG`, `wait`, `RS` and `mm` (matmuls, addmm included) in the order the generated `call` runs them."""
    found = []
    for line in code.splitlines():
        if "all_gather_into_tensor.default(" in line:
            found.append("AG")
        elif "reduce_scatter_tensor.default(" in line:
            found.append("RS")
        elif "wait_tensor.default(" in line:
            found.append("wait")
        elif re.search(r"extern_kernels\.(add)?mm\(", line):
            found.append("mm")
    return found


def test_inductor_generated_code_keeps_prefetch_and_late_waits():
    # Auto-bucketing off, so that each group keeps its own all-gather and the order is visible.
    # A budget that never binds: the schedule overlap alone decides, as in test_passes_schedule
    # (and no group is kept unsharded by it: unshard_selection off, so backward re-gathers).
    backend = fsdp_graph.backend(
        compiler="inductor", hardware_profile=FIXED.profile, disabled_passes={"auto_bucket", "unshard_selection"},
        memory_budget_bytes=1 << 50,
    )
    with fake_process_group(8):
        torch._dynamo.reset()
        compiled = torch.compile(sharded_stack(), backend=backend)
        _, codes = run_and_get_code(lambda: compiled(torch.randn(4, 16)).sum().backward())
    forward, backward = (" ".join(_calls(c)) for c in codes)
    # AG(i+1) (and AG(i+2) where the cost model asks for it) is issued before wait(AG(i)), hence
    # before compute(i): the passes' order, which Inductor's scheduler kept.
    assert forward == "AG AG wait AG AG wait mm mm wait mm mm wait mm mm mm", forward
    # Backward: the first re-gather at the very start, the next two before its wait; each RS right
    # after its gradient, and waited just before the next RS is issued (hidden, and its full-size
    # input dies early); the root's (the head's gradient) issued before blocks.0's gradients, which
    # hide it; the last waits at the end.
    assert backward == (
        "AG mm mm AG AG wait mm mm mm RS mm wait mm mm RS wait RS mm wait mm wait mm mm RS wait wait"
    ), backward
