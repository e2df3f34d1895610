"""Inductor keeps the schedule: the order in which a compiled step runs its collectives and
matmuls, compiled in pieces (the default) or as one graph, read from torch's profiler (a fake 8-rank
group; the example Llama on 2 gloo ranks)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import fsdp_graph
from _harness import fake_process_group, run_ranks
from _schedule_helpers import FIXED, sharded_stack
from fsdp_graph import fully_shard

pytestmark = pytest.mark.slow  # Inductor compiles cold


_RUN_NAMES = {"_c10d_functional::all_gather_into_tensor": "AG", "_c10d_functional::all_gather_into_tensor_out": "AG",
              "_c10d_functional::reduce_scatter_tensor": "RS", "_c10d_functional::all_reduce_": "RS",
              "_c10d_functional::wait_tensor": "wait", "aten::mm": "mm", "aten::addmm": "mm"}


def _ran(run) -> str:
    """`AG`, `wait`, `RS` and `mm` in the order `run()` calls them, from torch's profiler: the calls
    of Inductor's generated code, or of a program of pieces (fsdp_graph/compile/pieces.py). On gloo,
    a reduce-scatter is an in-place all-reduce of the bucket ([Note: Reduce-scatters on gloo])."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    events = sorted((e for e in prof.events() if e.name in _RUN_NAMES), key=lambda e: e.time_range.start)
    return " ".join(_RUN_NAMES[e.name] for e in events)


def _run_order(step) -> tuple[str, str]:
    """The run orders of the forward and of the backward of `step()` (a loss, compiled)."""
    out = []
    forward = _ran(lambda: out.append(step()))
    return forward, _ran(lambda: out[0].backward())


# The backward's order: inline, and with blocks 1 and 2 as calls of one compile region (see below).
_BACKWARD_ORDER = {
    "marked": "AG mm mm AG wait mm mm mm RS mm AG wait wait RS mm mm mm RS mm wait mm mm wait RS wait wait",
    "blocks": "AG mm AG wait mm mm mm mm RS AG wait mm mm mm mm RS wait RS mm wait mm mm wait RS wait wait",
}


@pytest.mark.parametrize("regions", ["marked", "blocks"])
def test_inductor_generated_code_keeps_prefetch_and_late_waits(tmp_path, monkeypatch, regions):
    # Auto-bucketing off, so that each group keeps its own all-gather and the order is visible.
    # A budget that never binds: the schedule overlap alone decides, as in test_passes_schedule
    # (and no group is kept unsharded by it: unshard_selection off, so backward re-gathers).
    # One graph (pieces=False): the order Inductor's generated code runs, in a second step (a program
    # of pieces runs the graph's order by construction: test_inductor_runs_the_order_the_passes_planned
    # checks both).
    backend = fsdp_graph.backend(
        compiler="inductor", hardware_profile=FIXED.profile, disabled_passes={"auto_bucket", "unshard_selection"},
        memory_budget_bytes=1 << 50, pieces=False, regions=regions,
    )
    # A cache of its own: the wire order a compile keeps there ([Note: One wire order per frame])
    # would hold the next one to its collectives' order (a program of pieces, scheduled before
    # Inductor's post-grad passes, issues two reduce-scatters the other way round).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with fake_process_group(8):
        torch._dynamo.reset()
        compiled = torch.compile(sharded_stack(), backend=backend)
        x = torch.randn(4, 16)
        compiled(x).sum().backward()
        forward, backward = _run_order(lambda: compiled(x).sum())
    # AG(i+1) is issued before wait(AG(i)), hence before compute(i): the passes' order, which
    # Inductor's scheduler kept. (AG(i+2) only where it hides more: with the shards read in place
    # from their buffers, no copy-in runs before an all-gather, and one ahead hides as much.)
    assert forward == "AG AG wait AG wait mm mm AG wait mm mm wait mm mm mm", forward
    # Backward: the first re-gather at the very start, the next before its wait; each RS right
    # after its gradient, and waited just before the next RS is issued (hidden, and its full-size
    # input dies early); the root's (the head's gradient) issued before blocks.0's gradients, which
    # hide it; the last waits at the end. With regions (blocks 1 and 2; block 0 traced inline) a
    # region's backward is one op to the passes: its four products run together, the next block's
    # re-gather issued before them and waited after.
    assert backward == _BACKWARD_ORDER[regions], backward




def _planned_and_ran(rank, world_size, dump_dir, pieces, regions):
    """Our example Llama's step compiled with Inductor on gloo, with the memory budget the
    per-model benchmark gives it: (kind, the order the scheduled program says, the order the
    step runs), in AG / RS / wait / mm."""
    from fsdp_graph.inspect.timeline import load_programs
    from fsdp_graph.passes.simulator import OpKind
    from _models import Llama, LlamaConfig, shard_llama

    torch.manual_seed(0)
    model = shard_llama(Llama(LlamaConfig(vocab_size=256, dim=256, num_layers=4, num_heads=4, hidden_dim=704,
                                          max_seq_len=65)), fully_shard)
    backend = fsdp_graph.backend(compiler="inductor", memory_budget_bytes=31 << 20, dump_dir=f"{dump_dir}/{rank}",
                                 pieces=pieces, regions=regions)
    compiled = torch.compile(model, backend=backend)
    tokens = torch.randint(0, 256, (4, 64))
    _, codes = run_and_get_code(lambda: compiled(tokens).sum().backward())
    # the calls the program of pieces or the generated code makes, as torch's profiler sees them in a second step
    ran = [order.split() for order in _run_order(lambda: compiled(tokens).sum())]
    programs = load_programs(f"{dump_dir}/{rank}")
    names = {OpKind.COLLECTIVE: "AG", OpKind.WAIT: "wait", OpKind.COMPUTE: "mm"}
    orders = []
    for kind, order in zip(("forward", "backward"), ran):
        (program,) = [p for label, p in programs.items() if label.endswith(kind)]
        planned = ["RS" if "reduce_scatter" in op.target else names[op.kind] for op in program
                   if op.kind in (OpKind.COLLECTIVE, OpKind.WAIT) or op.target in ("mm", "addmm")]
        orders.append((kind, planned, order))
    if not pieces:  # gloo's reduce-scatters, rewritten in place (passes/gloo.py)
        assert "reduce_scatter_tensor.default(" not in codes[1] and "all_reduce_.default(" in codes[1]
    return orders


@pytest.mark.parametrize("regions", ["marked", "blocks"])
@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "one_graph"])
def test_inductor_runs_the_order_the_passes_planned(tmp_path, pieces, regions):
    """The step issues and waits on each collective, and runs each matmul, in the order of the
    scheduled program the memory budget was judged on: a program of pieces by construction, and the
    one graph's generated code too. Inductor's own reorder_for_peak_memory,
    left on, postponed the backward's first weight-gradient matmuls and with them the all-gather
    pinned before them ([Note: Inductor keeps the planned order] in fsdp_graph/compile/backend.py).
    With regions="blocks" the program shows each region's matmuls where its call runs them: it
    showed the call as one op, which the inspector drew as one."""
    torch._dynamo.reset()
    for kind, planned, ran in run_ranks(_planned_and_ran, 2, str(tmp_path), pieces, regions):
        assert ran == planned, (kind, " ".join(ran), " ".join(planned))
