"""Train a small Llama-style decoder with fsdp_graph's fully_shard.

CPU / gloo (the default without CUDA):
    torchrun --nproc-per-node 2 examples/train_llama.py --steps 50
CUDA / NCCL (picked automatically when CUDA is present), compiled:
    torchrun --nproc-per-node 8 examples/train_llama.py --steps 200 --compile

The data is synthetic but learnable: each sequence follows t[i+1] = (a * t[i] + b) % vocab with a
per-sequence (a, b), so the loss falls quickly once the model picks the rule up from the context.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from llama import Llama, LlamaConfig, shard_llama

from fsdp_graph import MixedPrecisionPolicy, fully_shard


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
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def synthetic_batch(cfg: LlamaConfig, batch: int, seq_len: int, gen: torch.Generator, device) -> torch.Tensor:
    a = torch.randint(1, 8, (batch, 1), generator=gen)
    b = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    tokens = [torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)]
    for _ in range(seq_len):
        tokens.append((a * tokens[-1] + b) % cfg.vocab_size)
    return torch.cat(tokens, dim=1).to(device)


class ProgressBar:
    """A one-line progress bar on rank 0; plain lines when stdout is not a terminal."""

    def __init__(self, total: int, enabled: bool, width: int = 30) -> None:
        self.total, self.enabled, self.width = total, enabled, width
        self.tty = sys.stdout.isatty()
        self.start = time.perf_counter()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        done = step + 1
        filled = self.width * done // self.total
        rate = done / (time.perf_counter() - self.start)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text} ({rate:.1f} it/s)"
        if self.tty:
            print("\r" + line, end="\n" if done == self.total else "", flush=True)
        elif done == 1 or done == self.total or done % max(1, self.total // 10) == 0:
            print(line, flush=True)


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
    cfg = LlamaConfig(dim=args.dim, num_layers=args.layers, hidden_dim=args.dim * 8 // 3, max_seq_len=args.seq_len)
    model = Llama(cfg).to(device)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    shard_llama(model, fully_shard, mp_policy=mp_policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_fn = torch.compile(model, backend="fsdp_graph") if args.compile else model

    num_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"fsdp_graph: {num_params / 1e6:.2f}M parameters, {world_size} ranks on "
              f"{'cuda/nccl' if use_cuda else 'cpu/gloo'}, compile={args.compile}", flush=True)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    bar = ProgressBar(args.steps, enabled=rank == 0)
    first_loss = None
    for step in range(args.steps):
        tokens = synthetic_batch(cfg, args.batch_size, args.seq_len, gen, device)
        logits = step_fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = global_loss.item() / world_size
        first_loss = global_loss if first_loss is None else first_loss
        bar.update(step, f"loss {global_loss:.4f}")
    if rank == 0:
        print(f"loss {first_loss:.4f} -> {global_loss:.4f} after {args.steps} steps", flush=True)
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
