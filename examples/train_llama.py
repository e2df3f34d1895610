"""Train a small Llama-style decoder with fsdp_graph's fully_shard.

CPU / gloo (the default without CUDA):
    torchrun --nproc-per-node 2 examples/train_llama.py --steps 50
CUDA / NCCL (picked automatically when CUDA is present), compiled:
    torchrun --nproc-per-node 8 examples/train_llama.py --steps 200 --compile
Compiled once, loaded on every relaunch (no tracing; the first step then takes seconds):
    torchrun --nproc-per-node 2 examples/train_llama.py --steps 50 --compile --precompile-dir compiled
Inspect the compiled step: the graphs, the predicted schedule, and a measured one beside it:
    FSDP_GRAPH_DUMP=dump torchrun --nproc-per-node 2 examples/train_llama.py --compile --steps 2 --profile-dir prof
    python -m fsdp_graph.inspect dump --timeline timeline.svg --trace trace.json --measured prof/rank0.json
Muon on the blocks' matrices (each matrix's Newton-Schulz on one rank, see docs/optim.md), AdamW on the rest:
    torchrun --nproc-per-node 2 examples/train_llama.py --steps 50 --muon

The data is synthetic but learnable: each sequence follows t[i+1] = (a * t[i] + b) % vocab with a
per-sequence (a, b), so the loss falls quickly once the model picks the rule up from the context.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llama import Llama, LlamaConfig, llama_config, shard_llama
from progress import progress, write_profile

import fsdp_graph
from fsdp_graph import MixedPrecisionPolicy, fully_shard
from fsdp_graph.optim import Muon


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction")
    parser.add_argument("--compile", action="store_true", help="torch.compile(backend='fsdp_graph')")
    parser.add_argument("--precompile-dir", help="with --compile: fsdp_graph.precompile, whose first launch compiles "
                        "the step and saves it here, one file per rank; a relaunch loads it instead of tracing again")
    parser.add_argument("--profile-dir", help="write a torch.profiler Chrome trace of one step here, one file per rank")
    parser.add_argument("--muon", action="store_true", help="fsdp_graph.optim.Muon on the blocks' matrices, AdamW on the rest")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def synthetic_batch(cfg: LlamaConfig, batch: int, seq_len: int, gen: torch.Generator, device) -> torch.Tensor:
    a = torch.randint(1, 8, (batch, 1), generator=gen)
    b = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    tokens = [torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)]
    for _ in range(seq_len):
        tokens.append((a * tokens[-1] + b) % cfg.vocab_size)
    return torch.cat(tokens, dim=1).to(device)


def make_optimizers(model: Llama, lr: float, muon_cls=None) -> list[torch.optim.Optimizer]:
    """AdamW on every parameter; with `muon_cls` (e.g. `fsdp_graph.optim.Muon`), Muon on the blocks'
    weight matrices and AdamW on the rest (embedding, head, norms), the usual split for Muon."""
    if muon_cls is None:
        return [torch.optim.AdamW(model.parameters(), lr=lr)]
    matrices = [p for name, p in model.named_parameters() if name.startswith("layers.") and p.ndim == 2]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    return [muon_cls(matrices, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(others, lr=lr)]


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg = llama_config(args.dim, args.layers, args.seq_len)
    model = Llama(cfg).to(device)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    shard_llama(model, fully_shard, mp_policy=mp_policy)
    optimizers = make_optimizers(model, args.lr, Muon if args.muon else None)
    step_fn = torch.compile(model, backend="fsdp_graph") if args.compile and not args.precompile_dir else model

    num_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"fsdp_graph: {num_params / 1e6:.2f}M parameters, {world_size} ranks on "
              f"{'cuda/nccl' if use_cuda else 'cpu/gloo'}, compile={args.compile}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    steps = progress(range(args.steps), enabled=rank == 0)
    first_loss = None
    start = time.perf_counter()
    for step in steps:
        tokens = synthetic_batch(cfg, args.batch_size, args.seq_len, gen, device)
        # Profile the second step: the first compiles.
        profiling = args.profile_dir is not None and step == min(1, args.steps - 1)
        if step == 0 and args.compile and args.precompile_dir:
            step_fn = fsdp_graph.precompile(model, (tokens[:, :-1],), save_dir=args.precompile_dir)
        with write_profile(args.profile_dir, rank) if profiling else contextlib.nullcontext():
            logits = step_fn(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = global_loss.item() / world_size
        if first_loss is None:
            first_loss, first_step_s = global_loss, time.perf_counter() - start
        steps.set_postfix_str(f"loss {global_loss:.4f}")
    if rank == 0:
        print(f"loss {first_loss:.4f} -> {global_loss:.4f} after {args.steps} steps; the first step "
              f"(which compiles, or loads from the compile caches) took {first_step_s:.1f} s", flush=True)
    dist.barrier()
    if use_cuda:
        dist.destroy_process_group()
    else:
        # torch 2.13's gloo teardown aborts now and then ("terminate called without an active
        # exception"), also without fsdp_graph: all work is done, so exit without destructors.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
