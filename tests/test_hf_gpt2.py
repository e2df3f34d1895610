"""A transformers GPT2LMHeadModel (tied input/output embeddings, Conv1D weights stored transposed),
sharded per block and then at the root, trains like PyTorch's own `fully_shard` on the same model
and data: eager, and compiled by fsdp_graph (`aot_eager`). Skipped without the `hf` extra."""

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from _harness import run_ranks  # noqa: E402

STEPS = 3


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def _shard(model, shard):
    for block in model.transformer.h:
        shard(block)
    shard(model)
    return model


def _train(model, run, rank):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # One batch per rank, every step: the model memorizes it, so the loss falls within a few steps.
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(rank))
    losses, grads = [], []
    for _ in range(STEPS):
        logits = run(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.to_local().clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def _against_torch(rank, world_size):
    import fsdp_graph
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _gpt2()
    theirs = _shard(copy.deepcopy(model), torch_fully_shard)
    reference = _train(theirs, theirs, rank)
    results = {}
    for mode in ("eager", "compiled"):
        ours = _shard(copy.deepcopy(model), fsdp_graph.fully_shard)
        # The tie survives sharding: one DTensor for the embedding and the output projection.
        assert ours.lm_head.weight is ours.transformer.wte.weight
        run = torch.compile(ours, backend=fsdp_graph.backend(compiler="aot_eager")) if mode == "compiled" else ours
        results[mode] = _train(ours, run, rank)
    return reference, results


@pytest.mark.slow  # runs transformers' GPT-2, ours and torch's, eager and compiled
def test_gpt2_trains_like_torch_fully_shard():
    (ref_losses, ref_grads), results = run_ranks(_against_torch, 2, timeout_s=300)
    assert ref_losses[-1] < ref_losses[0]  # it learns: the comparison is not between two flat lines
    for mode, (losses, grads) in results.items():
        assert losses == pytest.approx(ref_losses, rel=1e-6), (mode, losses, ref_losses)
        for step, (ours, theirs) in enumerate(zip(grads, ref_grads)):
            assert ours.keys() == theirs.keys()
            for name in theirs:
                torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{mode} step {step} {name}: {m}")
