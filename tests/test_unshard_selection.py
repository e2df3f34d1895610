"""Selective unsharding (passes/unshard_selection.py): which groups a memory budget keeps unsharded,
and that keeping them changes no number.

Graph tests: one process, fake 2-rank process group, `aot_eager`; what the forward saves for
backward and what the backward gathers are read from the dumped graphs. Parity: 2 gloo ranks.
"""

import pytest
import torch

import fsdp_graph
from _compile_helpers import collective_groups, dumped_graphs, train_compiled_and_compare
from _harness import fake_process_group, run_ranks
from _models import MLPStack
from fsdp_graph import fully_shard
from fsdp_graph.dump import load_summary


def _shard(model):
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root keeps its parameters (reshard_after_forward=False)
    return model


def _compile_once(tmp_path, budget):
    torch._dynamo.reset()
    with fake_process_group(2):
        torch.manual_seed(0)
        model = _shard(MLPStack(dim=16, hidden=64, num_blocks=3))
        backend = fsdp_graph.backend(compiler="aot_eager", memory_budget_bytes=budget, dump_dir=str(tmp_path))
        torch.compile(model, backend=backend)(torch.randn(4, 16)).sum().backward()
    torch._dynamo.reset()
    (forward,) = [e["forward"] for e in load_summary(tmp_path)["graphs"].values()]
    kept = {s["group"] for s in forward["saved_unsharded"]} - {"<root>"}
    regathered = set(collective_groups(dumped_graphs(tmp_path), "backward", "all_gather_into_tensor"))
    sizes = {c["group"]: c["bytes"] for c in forward["collectives"] if c["op"] == "all_gather_into_tensor"}
    return kept, regathered, sizes, forward["kept_by_budget"]


def test_budget_between_two_groups_keeps_exactly_the_groups_that_fit(tmp_path):
    # No budget: today's schedule, every block re-gathered. A budget below today's peak: the same.
    kept, regathered, sizes, _ = _compile_once(tmp_path / "none", None)
    assert kept == set() and regathered == {"blocks.0", "blocks.1", "blocks.2"}
    assert _compile_once(tmp_path / "tiny", 1)[:2] == (set(), regathered)
    # Today's predicted peak (all resharded) plus one block fits the last block only: it is re-gathered
    # first in backward, with no compute before it to hide under. Half a block more changes nothing.
    baseline = _baseline_peak(tmp_path)
    block = sizes["blocks.2"]
    kept, regathered, _, costs = _compile_once(tmp_path / "one", baseline + block + block // 2)
    assert kept == {"blocks.2"} and regathered == {"blocks.0", "blocks.1"}
    assert costs == {"blocks.2": block}
    # Two blocks more: blocks.1 and then blocks.0 fit, the last one for free (with no group left to
    # re-gather, backward has no transient gathered block either).
    kept, regathered, _, _ = _compile_once(tmp_path / "all", baseline + 2 * block)
    assert kept == {"blocks.0", "blocks.1", "blocks.2"} and regathered == set()


def _baseline_peak(tmp_path) -> int:
    """The pass's predicted peak with every group resharded, from its log of a budget of 0 bytes."""
    from fsdp_graph.passes import unshard_selection

    seen = []
    original = unshard_selection.plan_unsharded

    def spy(gm, budget):
        choices = original(gm, budget)
        seen.extend(choices)
        return choices

    unshard_selection.plan_unsharded = spy
    try:
        _compile_once(tmp_path / "baseline", 0)
    finally:
        unshard_selection.plan_unsharded = original
    assert seen and not any(c.kept for c in seen)
    return seen[0].peak_bytes


def _parity(rank, world_size):
    results = {}
    for name, budget in {"without": None, "with": 1 << 40}.items():
        backend = fsdp_graph.backend(compiler="aot_eager", memory_budget_bytes=budget)
        torch.manual_seed(0)
        results[name] = train_compiled_and_compare(MLPStack(), _shard, backend, rank, world_size)["losses"]
    return results


def test_keeping_every_group_unsharded_changes_no_number():
    # Each run is checked bit for bit against the eager runtime (which reshards) and against an
    # unsharded model; both runs must give the same losses.
    results = run_ranks(_parity, 2)
    assert results["with"] == results["without"]
