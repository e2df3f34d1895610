"""examples/train_hf.py: a transformers LlamaForCausalLM, sharded per decoder layer and compiled by
fsdp_graph (`aot_eager`), trains like the unsharded model on the global batch, and a run resumed
from its DCP checkpoint continues exactly as the uninterrupted run. Skipped without the `hf` extra."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _harness import run_ranks  # noqa: E402

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
STEPS = 4


def _args(**overrides) -> argparse.Namespace:
    sys.path.insert(0, EXAMPLES)
    import train_hf

    argv = ["--steps", str(STEPS), "--batch-size", "2", "--seq-len", "16", "--layers", "2", "--hidden", "64",
            "--vocab", "128", "--lr", "1e-2"]
    args = train_hf.parse_args(argv)
    vars(args).update(overrides)
    return args


def _train_sharded(rank, world_size, checkpoint_dir):
    sys.path.insert(0, EXAMPLES)
    import fsdp_graph
    import train_hf

    backend = fsdp_graph.backend(compiler="aot_eager")
    device = torch.device("cpu")
    uninterrupted = train_hf.train(_args(), device, backend)
    first = train_hf.train(_args(steps=2, checkpoint_dir=checkpoint_dir), device, backend)
    resumed = train_hf.train(_args(checkpoint_dir=checkpoint_dir, resume=True), device, backend)
    return uninterrupted, first, resumed


def _train_unsharded(world_size):
    """The unsharded model, one process, on the global batch (every rank's rows) each step."""
    sys.path.insert(0, EXAMPLES)
    import train_hf

    args = _args()
    model = train_hf.build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(STEPS):
        tokens = torch.cat([train_hf.batch(args, step, rank, "cpu") for rank in range(world_size)])
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow  # runs transformers and DCP: the example's whole job
def test_hf_llama_trains_like_unsharded_and_resumes_from_dcp(tmp_path):
    uninterrupted, first, resumed = run_ranks(_train_sharded, 2, str(tmp_path / "checkpoint"), timeout_s=420)
    reference = _train_unsharded(2)
    assert uninterrupted == pytest.approx(reference, abs=2e-5), (uninterrupted, reference)
    assert reference[-1] < reference[0]  # it learns: the comparison is not between two flat lines
    # The resumed run starts at step 2 with the checkpoint's parameters and AdamW state: the same
    # losses as the run that never stopped, bit for bit (aot_eager, same data per step).
    assert first + resumed == uninterrupted
