"""Compiled steps over changing sequence lengths (issue #46, shapes): the whole-step graph goes
dynamic as torch's `fully_shard` + `torch.compile` does, instead of one graph per length, and trains
the same numbers. See [Note: Plans from size hints] in passes/nodes.py and [Note: One collective set
per frame] in passes/unshard_selection.py. 2 gloo ranks, aot_eager."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp_graph
from _harness import run_ranks
from _models import shard_llama, tiny_llama
from fsdp_graph import fully_shard


def _train(rank, world_size, lengths, impl, dynamic=None, mark_dynamic=False, backend_options=None, hooked=False):
    """One AdamW step per length; (graphs Dynamo compiled, losses, the last step's sharded gradients).
    `hooked`: every Linear gets a forward pre-hook of the user's (as TP's input hooks are)."""
    torch.manual_seed(0)
    model = tiny_llama(2)
    if hooked:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _module, args: (args[0] * 1.0,))
    model = shard_llama(model, torch_fully_shard if impl != "ours" else fully_shard)
    if impl == "torch-eager":
        run = model
    elif impl == "torch":
        run = torch.compile(model, backend="aot_eager", dynamic=dynamic)
    else:
        run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", **(backend_options or {})), dynamic=dynamic)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch._dynamo.utils.counters.clear()
    losses = []
    for step, length in enumerate(lengths):
        tokens = torch.randint(0, 64, (2, length + 1), generator=torch.Generator().manual_seed(10 * step + rank))
        inputs = tokens[:, :-1]
        if mark_dynamic:
            torch._dynamo.mark_dynamic(inputs, 1)
        loss = F.cross_entropy(run(inputs).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        if step < len(lengths) - 1:
            optimizer.step()
            optimizer.zero_grad()
    if impl == "ours":
        assert model._fsdp_state.ctx.fallbacks == {}, model._fsdp_state.ctx.fallbacks
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    return torch._dynamo.utils.counters["stats"]["unique_graphs"], losses, grads


_LENGTHS = [8, 12, 16, 20, 11, 24]


@functools.cache
def _torch_eager() -> tuple:
    """Torch's `fully_shard`, eager, over `_LENGTHS`: the reference, run once for the tests that share it."""
    return run_ranks(_train, 2, _LENGTHS, "torch-eager")


# automatic: over 13 s on a 2-core machine (docs/testing.md)
@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic=True"])
def test_new_lengths_do_not_recompile_the_whole_step(dynamic):
    """Each length compiled a graph of its own: a pass turned the symbolic length into an int, which
    guarded the graph to that length (`Eq(2*s50, 24)`)."""
    ours_graphs, ours_losses, ours_grads = run_ranks(_train, 2, _LENGTHS, "ours", dynamic)
    torch_graphs, _, _ = run_ranks(_train, 2, _LENGTHS, "torch", dynamic)
    _, losses, grads = _torch_eager()
    assert ours_graphs <= min(torch_graphs, 2), (ours_graphs, torch_graphs)
    assert ours_losses == losses  # bit for bit: aot_eager against torch's fully_shard, eager
    for name, grad in grads.items():
        assert torch.equal(ours_grads[name], grad), name


def test_marked_dynamic_dim_compiles_once():
    graphs, losses, _ = run_ranks(_train, 2, _LENGTHS, "ours", None, True)
    assert graphs == 1
    assert losses == _torch_eager()[1]


def test_submodules_with_hooks_of_their_own_compile_once():
    """The group's call checks on submodules were lifted while Dynamo compiled: on a submodule with
    a hook of its own, Dynamo guarded the hook dict's length without the check, and every step
    recompiled, until the recompile limit sent the step to the eager hooks ([Note: Owner checks
    while compiling] in traced/callbacks.py)."""
    lengths = [8, 8, 8, 8]
    graphs, losses, grads = run_ranks(_train, 2, lengths, "ours", None, False, None, True)
    _, reference, reference_grads = run_ranks(_train, 2, lengths, "torch-eager", None, False, None, True)
    assert graphs == 1  # torch's fully_shard + compile: 4 graphs here, 2 without the hooks
    assert losses == reference
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.slow  # 14 s, over the 13 s rule (docs/testing.md)
def test_a_memory_budget_does_not_recompile_for_a_longer_length():
    """With a budget that keeps groups gathered, a later graph of the frame keeps the groups the
    first one kept, at any size ([Note: One collective set per frame]): [16, 12, 8, 20] compile a
    static graph and a dynamic one, which serves 8 and the longer 20, as without the budget. (The
    dynamic graph was bounded to its planned sizes before, and 20 compiled a third graph.)"""
    lengths = [16, 12, 8, 20]
    with_budget = run_ranks(_train, 2, lengths, "ours", None, False, {"memory_budget_bytes": 1 << 40})
    without = run_ranks(_train, 2, lengths, "ours")
    assert (with_budget[0], without[0]) == (2, 2)
    reference = run_ranks(_train, 2, lengths, "torch-eager")[1]
    assert with_budget[1] == reference and without[1] == reference
