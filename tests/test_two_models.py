"""Two models of the same classes in one process (issue #77 item 1), one after the other and
interleaved step by step, each with changes after `fully_shard` (a group frozen before sharding and
unfrozen later, a parameter replaced, `.to(dtype)`), through every compile mode, on 2 gloo ranks:
each trains as if alone, against its own unsharded reference on the global batch. A sweep, a
notebook re-run, a train and an eval copy, a reward model beside a policy and a test suite all build
several models in one process, and reset Dynamo between them. See [Note: Process-wide state] in
traced/callbacks.py.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor

import fsdp_graph
from _harness import run_ranks
from _models import MLPStack, batch_for_step, check_grads_match, check_params_match, loss_fn, shard_blocks_then_root
from fsdp_graph import fully_shard

_BLOCK_1 = {f"blocks.1.{layer}.{kind}" for layer in ("up", "down") for kind in ("weight", "bias")}
_STEPS = 4


class _Run:
    """One model: its unsharded reference, our sharded copy and the compiled call, stepped one step
    at a time. Step 0 trains with block 1 frozen (since before `fully_shard`); step 1 unfreezes it;
    step 2 replaces the head's weight with a new parameter; step 3 runs in float64. SGD without
    state, built anew each step, so that replaced and converted parameters need no optimizer surgery."""

    def __init__(self, seed: int, options: dict) -> None:
        torch.manual_seed(seed)
        model = MLPStack()
        for name, p in model.named_parameters():
            p.requires_grad_(name not in _BLOCK_1)
        self.reference = copy.deepcopy(model)
        self.ours = shard_blocks_then_root(copy.deepcopy(model), fully_shard)
        self.call = torch.compile(self.ours, backend=fsdp_graph.backend(**options))
        self.seed = seed
        self.dtype = torch.float32

    def _change_before(self, step: int) -> None:
        models = (self.reference, self.ours)
        if step == 1:
            for m in models:
                m.requires_grad_(True)
        elif step == 2:
            full = 0.1 * torch.randn(self.reference.head.weight.shape, generator=torch.Generator().manual_seed(self.seed))
            self.reference.head.weight = nn.Parameter(full.clone())
            shard = self.ours.head.weight
            self.ours.head.weight = nn.Parameter(distribute_tensor(full, shard.device_mesh, shard.placements))
        elif step == 3:
            self.dtype = torch.float64
            for m in models:
                m.to(self.dtype)

    def step(self, step: int, rank: int, world_size: int) -> None:
        self._change_before(step)
        x, y, lx, ly = batch_for_step(self.reference, step, 8, rank, world_size)
        loss_fn(self.reference, self.reference(x.to(self.dtype)), y.to(self.dtype)).backward()
        loss_fn(self.ours, self.call(lx.to(self.dtype)), ly.to(self.dtype)).backward()
        frozen = _BLOCK_1 if step == 0 else set()
        no_grad = {name for name, p in self.ours.named_parameters() if p.grad is None}
        assert no_grad == frozen, f"seed {self.seed} step {step}: no gradient for {sorted(no_grad - frozen)}"
        check_grads_match(self.ours, self.reference)
        for m in (self.reference, self.ours):
            torch.optim.SGD(m.parameters(), lr=0.1).step()
            m.zero_grad()

    def check(self) -> None:
        check_params_match(self.ours, self.reference, atol=1e-5)
        assert self.ours._fsdp_state.ctx.fallbacks == {}, self.ours._fsdp_state.ctx.fallbacks


def _two_models(rank, world_size, options):
    # One after the other, resetting Dynamo between them as test suites and notebooks do.
    first = _Run(0, options)
    for step in range(_STEPS):
        first.step(step, rank, world_size)
    first.check()
    torch._dynamo.reset()
    second = _Run(1, options)
    for step in range(_STEPS):
        second.step(step, rank, world_size)
    second.check()
    # Interleaved step by step, both alive, with a reset half-way that finds both models built
    # and only ever called compiled.
    runs = [_Run(2, options), _Run(3, options)]
    for step in range(_STEPS):
        if step == 2:
            torch._dynamo.reset()
        for run in runs:
            run.step(step, rank, world_size)
    for run in runs:
        run.check()


_MODES = {
    "aot_eager-blocks": {"compiler": "aot_eager"},
    "aot_eager-marked": {"compiler": "aot_eager", "regions": "marked"},
    "aot_eager-block_scope": {"compiler": "aot_eager", "scope": "block"},
    "inductor-blocks": {},
}


@pytest.mark.parametrize(
    # inductor compiles cold; aot_eager-blocks is over 13 s on a quiet 2-core machine (docs/testing.md),
    # its block-scope case keeps two models in the inner loop
    "mode", [pytest.param(m, marks=[pytest.mark.slow] if m.startswith("inductor") or m.endswith(("marked", "blocks")) else [])
             for m in _MODES]
)
def test_two_models_of_the_same_classes_each_train_as_if_alone(mode):
    run_ranks(_two_models, 2, _MODES[mode], timeout_s=600)
