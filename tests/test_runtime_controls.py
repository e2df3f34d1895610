"""Explicit controls (unshard, prefetch, accumulation, resharding choices) never change the numbers."""

import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from _harness import run_ranks
from _models import (
    Boom, MLPStack, backward_on_both, batch_for_step, check_grads_match, comm_counts, loss_fn, paired_llama,
    shard_llama, tiny_llama, train_and_compare,
)
from fsdp_graph import FSDPModule, fully_shard, register_fsdp_forward_method


def _with_prefetch(kind):
    def shard(m):
        shard_llama(m, fully_shard)
        layers = list(m.layers)
        for i, layer in enumerate(layers):
            if kind == "forward" and i + 1 < len(layers):
                layer.set_modules_to_forward_prefetch([layers[i + 1]])
            if kind == "backward" and i > 0:
                layer.set_modules_to_backward_prefetch([layers[i - 1]])
        return m
    return shard


def _explicit_unshard(m):
    # Before each forward (after the optimizer was built on the shards): pre-forward finds these
    # groups gathered already.
    m.unshard()
    handle = m.layers[0].unshard(async_op=True)
    m.layers[1].unshard()
    m.layers[1].reshard()
    handle.wait()


def _prefetch_parity(rank, world_size, kind):
    torch.manual_seed(0)
    model = tiny_llama(num_layers=3)
    plain = train_and_compare(model, lambda m: shard_llama(m, fully_shard), rank, world_size)
    before_forward = _explicit_unshard if kind == "unshard" else None
    controlled = train_and_compare(model, _with_prefetch(kind), rank, world_size, before_forward=before_forward)
    assert controlled == plain  # bitwise: prefetching changes when, never what


@pytest.mark.parametrize("kind", ["forward", "backward", "unshard"])
def test_prefetch_and_explicit_unshard_keep_numbers(kind):
    run_ranks(_prefetch_parity, 2, kind)


def _accumulation(rank, world_size, reshard_after_backward):
    model, reference, sharded = paired_llama()
    sharded.set_reshard_after_backward(reshard_after_backward)
    num_micro = 3
    counts = collections.Counter()
    for micro in range(num_micro):
        x, y, lx, ly = batch_for_step(model, micro, 8, rank, world_size)
        (loss_fn(reference, reference(x), y) / num_micro).backward()
        sharded.set_requires_gradient_sync(micro == num_micro - 1)
        with CommDebugMode() as mode:  # one mode per forward: its module tracker expects that
            (loss_fn(sharded, sharded(lx), ly) / num_micro).backward()
        counts.update(comm_counts(mode))
    for m in sharded.modules():  # groups left gathered show their unsharded parameters
        if isinstance(m, FSDPModule):
            m.reshard()
    check_grads_match(sharded, reference)
    # Gradients are reduced once, on the last micro-batch only: one reduce-scatter per group.
    assert counts["_reduce_scatter_base_"] == 3, counts


@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_gradient_accumulation_without_sync(reshard_after_backward):
    run_ranks(_accumulation, 2, reshard_after_backward)


def _kept_after_backward(model):
    shard_llama(model, fully_shard)
    model.set_reshard_after_backward(False)  # every group stays gathered after each backward
    return model


def _step_with_groups_kept(rank, world_size):
    torch.manual_seed(0)
    train_and_compare(tiny_llama(), _kept_after_backward, rank, world_size, steps=3, compare_grads=False)


def test_optimizer_step_regathers_groups_kept_after_backward():
    """The step changes the shards, so the copies a group kept gathered are stale: the next forward
    must gather again (torch's fully_shard reuses them for one step). Losses every step and the
    final parameters against the unsharded model; gradients of gathered groups are checked in
    test_gradient_accumulation_without_sync."""
    run_ranks(_step_with_groups_kept, 2)


def _int_reshard(rank, world_size):
    torch.manual_seed(0)
    model = tiny_llama()
    train_and_compare(model, lambda m: shard_llama(m, fully_shard, reshard_after_forward=2), rank, world_size)
    sharded = shard_llama(copy.deepcopy(model), fully_shard, reshard_after_forward=2)
    _, _, x, y = batch_for_step(model, 0, 8, rank, world_size)
    with CommDebugMode() as mode:
        loss_fn(sharded, sharded(x), y).backward()
    return comm_counts(mode)


def test_reshard_after_forward_to_smaller_group():
    counts = run_ranks(_int_reshard, 4)
    # 3 groups (2 blocks and the root, all given the int) gathered in forward, again (within
    # pairs of ranks) in backward.
    assert counts == {"_allgather_base_": 6, "_reduce_scatter_base_": 3}


def _error_recovery(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(Boom(), Boom(), nn.Linear(4, 1))
    reference = copy.deepcopy(model)
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    model[1].fail = True
    with pytest.raises(RuntimeError, match="user error"):
        model(torch.randn(2, 4))
    model[1].fail = False
    assert all(isinstance(p, DTensor) for p in model[0].parameters())  # pre-forward reset
    x = torch.randn(4, 4)
    model(x[rank * 2:(rank + 1) * 2]).sum().backward()
    (reference(x).sum() / world_size).backward()
    check_grads_match(model, reference)


def test_forward_error_leaves_model_usable():
    run_ranks(_error_recovery, 2)


def _backward_error_recovery(rank, world_size):
    model, reference, sharded = paired_llama()
    x, y, lx, ly = batch_for_step(model, 0, 8, rank, world_size)
    out = sharded(lx)

    def fail(_grad):
        raise RuntimeError("error in backward")

    out.register_hook(lambda g: g)
    h = sharded.layers[0](sharded.tok_embeddings(lx), sharded.rope_cos[:8, None], sharded.rope_sin[:8, None])
    h.register_hook(fail)
    with pytest.raises(RuntimeError, match="error in backward"):
        (loss_fn(sharded, out, ly) + h.sum()).backward()
    sharded.zero_grad()
    loss_fn(reference, reference(x), y).backward()
    loss_fn(sharded, sharded(lx), ly).backward()
    check_grads_match(sharded, reference)


def test_backward_error_leaves_model_usable():
    run_ranks(_backward_error_recovery, 2)


class WithGenerate(MLPStack):
    def score(self, x):
        return self.head(self.inp(x)).squeeze(-1)


def _forward_method(rank, world_size):
    for before in (False, True):
        torch.manual_seed(0)
        model = WithGenerate()
        reference = copy.deepcopy(model)
        # On a module not sharded (yet) it does nothing, as FSDP2's (one script with and without
        # sharding); a `fully_shard` afterwards registers it, where FSDP2's would not.
        register_fsdp_forward_method(reference, "score")
        if before:
            register_fsdp_forward_method(model, "score")
            register_fsdp_forward_method(model, "score")
        fully_shard(model)
        if not before:
            register_fsdp_forward_method(model, "score")
        x = torch.randn(4, 13)
        model.score(x).sum().backward()
        (reference.score(x).sum()).backward()
        check_grads_match(model, reference)


def test_register_fsdp_forward_method():
    run_ranks(_forward_method, 2)


def _divide_factor(rank, world_size):
    torch.manual_seed(0)
    model = MLPStack()
    reference = copy.deepcopy(model)
    fully_shard(model)
    model.set_gradient_divide_factor(1.0)  # sum instead of mean
    x = torch.randn(4, 13)
    model(x).sum().backward()
    (reference(x).sum() * world_size).backward()  # every rank saw the same x
    check_grads_match(model, reference)


def test_gradient_divide_factor():
    run_ranks(_divide_factor, 2)


def _not_last_backward(rank, world_size):
    model, reference, sharded = paired_llama()
    sharded.set_is_last_backward(False)  # backward does not wait for its last reduce-scatter
    lx, ly = backward_on_both(reference, sharded, 0, rank, world_size)
    sharded.set_is_last_backward(True)
    with torch.no_grad():
        sharded(lx)  # the next root forward finishes what is pending
    check_grads_match(sharded, reference)


def test_is_last_backward_false_defers_waiting():
    run_ranks(_not_last_backward, 2)
