"""Inductor keeps the schedule: the order of collectives in its generated code (a fake 8-rank group;
the example Llama on 2 gloo ranks)."""

import re

import torch
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from _harness import fake_process_group, run_ranks
from _schedule_helpers import FIXED, sharded_stack
from fsdp_graph import fully_shard


def _calls(code: str) -> list[str]:
    """`AG`, `wait`, `RS` and `mm` (matmuls, addmm included) in the order the generated `call` runs them."""
    found = []
    for line in code.splitlines():
        if "all_gather_into_tensor.default(" in line:
            found.append("AG")
        elif "reduce_scatter_tensor.default(" in line or "all_reduce_.default(" in line:
            found.append("RS")  # on gloo, an in-place all-reduce of the bucket: [Note: Reduce-scatters on gloo]
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
    # AG(i+1) is issued before wait(AG(i)), hence before compute(i): the passes' order, which
    # Inductor's scheduler kept. (AG(i+2) only where it hides more: with the shards read in place
    # from their buffers, no copy-in runs before an all-gather, and one ahead hides as much.)
    assert forward == "AG AG wait AG wait mm mm AG wait mm mm wait mm mm mm", forward
    # Backward: the first re-gather at the very start, the next before its wait; each RS right
    # after its gradient, and waited just before the next RS is issued (hidden, and its full-size
    # input dies early); the root's (the head's gradient) issued before blocks.0's gradients, which
    # hide it; the last waits at the end.
    assert backward == (
        "AG mm mm AG wait mm mm mm RS mm AG wait wait RS mm mm mm RS mm wait mm mm wait RS wait wait"
    ), backward




def _planned_and_ran(rank, world_size, dump_dir):
    """Our example Llama's step compiled with Inductor on gloo, with the memory budget the
    per-model benchmark gives it: (kind, the order the scheduled program says, the order the
    generated code runs), in AG / RS / wait / mm."""
    from fsdp_graph.inspect.timeline import load_programs
    from fsdp_graph.passes.simulator import OpKind
    from _models import Llama, LlamaConfig, shard_llama

    torch.manual_seed(0)
    model = shard_llama(Llama(LlamaConfig(vocab_size=256, dim=256, num_layers=4, num_heads=4, hidden_dim=704,
                                          max_seq_len=65)), fully_shard)
    backend = fsdp_graph.backend(compiler="inductor", memory_budget_bytes=31 << 20, dump_dir=f"{dump_dir}/{rank}")
    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 256, (4, 64))
    _, codes = run_and_get_code(lambda: compiled(tokens).sum().backward())
    programs = load_programs(f"{dump_dir}/{rank}")
    names = {OpKind.COLLECTIVE: "AG", OpKind.WAIT: "wait", OpKind.COMPUTE: "mm"}
    orders = []
    for kind, code in zip(("forward", "backward"), codes):
        (program,) = [p for label, p in programs.items() if label.endswith(kind)]
        planned = ["RS" if "reduce_scatter" in op.target else names[op.kind] for op in program
                   if op.kind in (OpKind.COLLECTIVE, OpKind.WAIT) or op.target in ("mm", "addmm")]
        code = code.replace("all_gather_into_tensor_out.default(", "all_gather_into_tensor.default(")  # gloo's
        if kind == "backward":  # gloo's reduce-scatters, rewritten in place (passes/gloo.py)
            assert "reduce_scatter_tensor.default(" not in code and "all_reduce_.default(" in code
        orders.append((kind, planned, _calls(code)))
    return orders


def test_inductor_runs_the_order_the_passes_planned(tmp_path):
    """The generated code issues and waits on each collective, and runs each matmul, in the order of
    the scheduled program the memory budget was judged on. Inductor's own reorder_for_peak_memory,
    left on, postponed the backward's first weight-gradient matmuls and with them the all-gather
    pinned before them ([Note: Inductor keeps the planned order] in fsdp_graph/compile/backend.py)."""
    torch._dynamo.reset()
    for kind, planned, ran in run_ranks(_planned_and_ran, 2, str(tmp_path)):
        assert ran == planned, (kind, " ".join(ran), " ".join(planned))
