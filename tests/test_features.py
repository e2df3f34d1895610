"""FSDP2 features beyond plain training, in the eager runtime: activation checkpointing, gradient
clipping, CPU offload, meta-device init."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint

from _harness import run_ranks
from _models import (
    backward_on_both, paired_llama,
    Llama, MLPStack, batch_for_step, check_grads_match, check_params_match, comm_counts, loss_fn, shard_llama, tiny_llama,
    shard_blocks_then_root, train_and_compare,
)
from fsdp_graph import CPUOffloadPolicy, fully_shard


class CheckpointedLlama(Llama):
    """Recomputes every block in backward (torch.utils.checkpoint inside forward)."""

    def forward(self, tokens):
        seq = tokens.shape[1]
        cos, sin = self.rope_cos[:seq, None, :], self.rope_sin[:seq, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False)
        return self.output(self.norm(h))


def _wrapped_blocks(model):
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    return model


def _activation_checkpointing(rank, world_size, how):
    torch.manual_seed(0)
    model = tiny_llama()
    if how == "checkpoint":
        model.__class__ = CheckpointedLlama
    else:
        model = _wrapped_blocks(model)
    train_and_compare(model, lambda m: shard_llama(m, fully_shard), rank, world_size, steps=3)
    counts = []
    for m in (model, tiny_llama()):  # with and without recomputation
        sharded = shard_llama(copy.deepcopy(m), fully_shard)
        _, _, x, y = batch_for_step(m, 0, 8, rank, world_size)
        with CommDebugMode() as mode:
            loss_fn(sharded, sharded(x), y).backward()
        counts.append(comm_counts(mode))
    assert counts[0] == counts[1], counts  # recomputation gathers nothing extra


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint_wrapper"])
def test_activation_checkpointing(how):
    run_ranks(_activation_checkpointing, 2, how)


def clip_like_unsharded(reference: nn.Module, sharded: nn.Module) -> None:
    """`clip_grad_norm_` on both: the same total norm, clipping happened, the same clipped gradients."""
    ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    norm = nn.utils.clip_grad_norm_(sharded.parameters(), max_norm=0.1)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
    assert ref_norm > 0.1  # clipping did something
    check_grads_match(sharded, reference)


def _clip(rank, world_size):
    model, reference, sharded = paired_llama()
    backward_on_both(reference, sharded, 0, rank, world_size)
    clip_like_unsharded(reference, sharded)


def test_clip_grad_norm_matches_unsharded():
    run_ranks(_clip, 2)


def _offload(rank, world_size):
    torch.manual_seed(0)

    def shard(m):
        shard_llama(m, fully_shard, offload_policy=CPUOffloadPolicy(pin_memory=False))
        assert all(p.device.type == "cpu" for p in m.parameters())
        return m

    train_and_compare(tiny_llama(), shard, rank, world_size, steps=3)


def test_cpu_offload_policy_trains_like_unsharded():
    run_ranks(_offload, 2)


def _deterministic_init(model):
    # Deterministic, so the sharded (DTensor) and the plain init must agree exactly. DTensor random
    # ops are only rank-consistent on CUDA (see docs/runtime.md, Known limits).
    for i, (name, p) in enumerate(model.named_parameters()):
        nn.init.constant_(p, 0.05 * (i % 5) - 0.1)


def meta_sharded_mlp(_unused=None, init=_deterministic_init) -> MLPStack:
    """An MLPStack built on meta, sharded (blocks, root), materialized on CPU, then `init(model)`."""
    with torch.device("meta"):
        model = MLPStack()
    shard_blocks_then_root(model)
    model.to_empty(device="cpu")
    init(model)
    return model


def _meta_init(rank, world_size):
    reference = MLPStack()
    _deterministic_init(reference)
    model = meta_sharded_mlp()
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), reference.get_parameter(name).detach()), name
    torch.manual_seed(0)
    train_and_compare(reference, lambda m: model, rank, world_size, steps=3)


def test_meta_device_init_then_to_empty():
    run_ranks(_meta_init, 2)


def grad_scaler_run(rank, world_size, compiled):
    """`torch.amp.GradScaler` on a sharded model against the unsharded model with its own scaler.

    Step 1 puts an inf into one gradient row that only rank 1 holds (and into the same row of the
    reference): the scaler must skip the step on every rank, as it does on the reference, and back
    off its scale; the other steps must step and match.
    """
    import fsdp_graph

    model, reference, sharded = paired_llama()
    run = torch.compile(sharded, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else sharded
    poisoned = "layers.1.feed_forward.w1.weight"
    row = sharded.get_parameter(poisoned).shape[0] - 1  # the last row: rank 1's shard
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2) for _ in range(2)]
    scales = []
    for step in range(4):
        x, y, lx, ly = batch_for_step(model, step, 8, rank, world_size)
        for m, forward, batch, opt, scaler in zip(
            (reference, sharded), (reference, run), ((x, y), (lx, ly)), optimizers, scalers
        ):
            scaler.scale(loss_fn(m, forward(batch[0]), batch[1])).backward()
            if step == 1:
                grad = m.get_parameter(poisoned).grad
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                if not isinstance(grad, DTensor) or rank == world_size - 1:
                    local[-1 if isinstance(grad, DTensor) else row, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append((scalers[0].get_scale(), scalers[1].get_scale()))
        check_params_match(sharded, reference, atol=1e-5)
    return scales


def test_grad_scaler_skips_and_steps_like_unsharded():
    scales = run_ranks(grad_scaler_run, 2, False)
    assert [s for s, _ in scales] == [s for _, s in scales], scales
    assert [s for s, _ in scales] == [2.0**16, 2.0**15, 2.0**15, 2.0**16], scales  # skip at step 1, regrow


def _meta_random_init(rank, world_size):
    """Random init of a meta-built sharded model, on CPU, equal to initialising before sharding:
    init the full parameters inside `summon_full_params(writeback=True)` with the same seed on
    every rank (DTensor's own rank-consistent RNG is CUDA-only; see docs/runtime.md, Known limits)."""
    from fsdp_graph.fsdp1.full_params import summon_full_params

    def reset(model):
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

    def init_full(model):
        with summon_full_params(model, writeback=True):
            torch.manual_seed(0)
            reset(model)

    torch.manual_seed(0)
    reference = MLPStack()
    model = meta_sharded_mlp(init=init_full)
    torch.manual_seed(0)
    reset(reference)  # the same calls in the same order on the unsharded model
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert torch.equal(p.full_tensor(), reference.get_parameter(name).detach()), name
    train_and_compare(reference, lambda m: model, rank, world_size, steps=2)


def test_meta_device_random_init_through_summon_full_params():
    run_ranks(_meta_random_init, 2)
