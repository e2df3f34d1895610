"""Train a Hugging Face `transformers` LlamaForCausalLM with fsdp_graph, and checkpoint it with DCP.

Needs the `hf` extra (`pip install -e '.[hf]'`). The model is built from a small `LlamaConfig`
(nothing is downloaded): one `fully_shard` group per decoder layer and one for the root, then
`torch.compile(backend="fsdp_graph")`. The loss is the model's own (`labels=` in, `ModelOutput.loss`
out). The checkpoint is torch.distributed.checkpoint (DCP): each rank writes its shards of the model
and of the AdamW state, and `--resume` continues where it stopped, with the same data.

CPU / gloo, 2 ranks:
    torchrun --nproc-per-node 2 examples/train_hf.py --steps 20 --checkpoint-dir /tmp/hf_ckpt
    torchrun --nproc-per-node 2 examples/train_hf.py --steps 40 --checkpoint-dir /tmp/hf_ckpt --resume
CUDA / NCCL (picked automatically when CUDA is present):
    torchrun --nproc-per-node 8 examples/train_hf.py --steps 200 --hidden 512 --layers 8
Add `--eager` to skip torch.compile, `--profile-dir DIR` for a torch.profiler trace of one step,
`--regions` to compile the decoder layers' code once for all layers (each layer's forward a
`torch.compiler.nested_compile_region`; the step stays one graph: docs/compiler.md, Compile cost):
    torchrun --nproc-per-node 2 examples/train_hf.py --layers 16 --regions
or `--scope block` to compile block by block as FSDP2 + torch.compile does (the collectives on the eager
runtime's hooks; the compile time flat in depth: docs/compiler.md, Compile cost):
    torchrun --nproc-per-node 2 examples/train_hf.py --layers 16 --scope block
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from progress import progress, write_profile
import fsdp_graph
from fsdp_graph import fully_shard

CHECKPOINT_STEP_FILE = "step.txt"  # the number of steps the checkpoint holds, written by rank 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="train until this many steps in all (with --resume too)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--regions", action="store_true", help="compile the decoder layers as one nested_compile_region")
    parser.add_argument("--scope", choices=("step", "block"), default="step",
                        help="what one compiled graph spans: the whole step, or one block (fsdp_graph.backend(scope=...))")
    parser.add_argument("--checkpoint-dir", help="save a DCP checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="load the checkpoint in --checkpoint-dir first")
    parser.add_argument("--profile-dir", help="write a torch.profiler Chrome trace of one step here, one file per rank")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    return args


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A tiny Llama; the same initial weights on every rank (seeded)."""
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, use_cache=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


class RegionDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose code torch.compile compiles once for all layers (`--regions`)."""

    forward = torch.compiler.nested_compile_region(LlamaDecoderLayer.forward)


def shard(model: LlamaForCausalLM, regions: bool = False) -> LlamaForCausalLM:
    for layer in model.model.layers:  # one group per decoder layer,
        if regions:
            layer.__class__ = RegionDecoderLayer
        fully_shard(layer)
    fully_shard(model)  # then the root: embedding, final norm, lm_head
    return model


def batch(args: argparse.Namespace, step: int, rank: int, device) -> torch.Tensor:
    """Token ids for `rank` at `step`, from a generator seeded by both: a resumed run sees the same
    data. Each row follows t[i+1] = (a * t[i] + b) % vocab, learnable from the context."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    a = torch.randint(1, 8, (args.batch_size, 1), generator=gen)
    b = torch.randint(0, args.vocab, (args.batch_size, 1), generator=gen)
    tokens = [torch.randint(0, args.vocab, (args.batch_size, 1), generator=gen)]
    for _ in range(args.seq_len - 1):
        tokens.append((a * tokens[-1] + b) % args.vocab)
    return torch.cat(tokens, dim=1).to(device)


def save(checkpoint_dir: str, model, optimizer, step: int) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)
    # A resumed run replaces the checkpoint it started from (DCP warns about that even when asked to).
    writer = dcp.FileSystemWriter(checkpoint_dir, overwrite=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer)
    if dist.get_rank() == 0:
        Path(checkpoint_dir, CHECKPOINT_STEP_FILE).write_text(str(step))
    dist.barrier()


def load(checkpoint_dir: str, model, optimizer) -> int:
    """Load the checkpoint into the sharded model and optimizer; the number of steps it holds."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(Path(checkpoint_dir, CHECKPOINT_STEP_FILE).read_text())


def train(args: argparse.Namespace, device, compile_backend=None) -> list[float]:
    """Train (resuming if asked) until `args.steps`; the global loss of each step run here."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = shard(build_model(args).to(device), regions=args.regions)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = load(args.checkpoint_dir, model, optimizer) if args.resume else 0
    if compile_backend is None:
        compile_backend = fsdp_graph.backend(scope=args.scope)
    step_fn = model if args.eager else torch.compile(model, backend=compile_backend)
    losses = []
    steps = progress(range(start, args.steps), enabled=rank == 0, initial=start, total=args.steps)
    for step in steps:
        tokens = batch(args, step, rank, device)
        # Profile the second step run here: the first compiles.
        profiling = args.profile_dir is not None and step == min(start + 1, args.steps - 1)
        with write_profile(args.profile_dir, rank) if profiling else contextlib.nullcontext():
            out = step_fn(input_ids=tokens, labels=tokens)  # a CausalLMOutputWithPast; the loss shifts labels itself
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
        steps.set_postfix_str(f"loss {losses[-1]:.4f}")
    if args.checkpoint_dir:
        save(args.checkpoint_dir, model, optimizer, args.steps)
    return losses


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    losses = train(args, device)
    if dist.get_rank() == 0 and losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps"
              + (f", checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""), flush=True)
    dist.barrier()
    if use_cuda:
        dist.destroy_process_group()
    else:
        # torch 2.13's gloo teardown aborts now and then (see docs/reliability.md, Known limits): exit without destructors.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
