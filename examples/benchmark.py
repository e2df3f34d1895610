"""Benchmark fsdp_graph against PyTorch's FSDP2 on the same Llama-style model, in one run.

CPU / gloo:
    torchrun --nproc-per-node 2 examples/benchmark.py
    torchrun --nproc-per-node 2 examples/benchmark.py --rounds 20 --layers 8 --dim 256

Both sides get the same model, data and optimizer. Steps alternate between them so drift in machine
load hits both alike. Per side it prints the median step time, the peak live tensor memory of one
step (torch's MemTracker, max over ranks), the collectives of one step (CommDebugMode), and the
ratios fsdp_graph / FSDP2. This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from llama import Llama, LlamaConfig, shard_llama

from fsdp_graph import fully_shard


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reshard-after-forward", choices=["default", "true", "false"], default="default")
    return parser.parse_args()


class Side:
    """One implementation under test: its model, optimizer and measurements."""

    def __init__(self, name: str, shard_fn, cfg: LlamaConfig, reshard_after_forward) -> None:
        self.name = name
        torch.manual_seed(0)
        self.model = shard_llama(Llama(cfg), shard_fn, reshard_after_forward=reshard_after_forward)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.peak_bytes = 0
        self.collectives: dict[str, int] = {}

    def step(self, tokens: torch.Tensor) -> float:
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def timed_step(self, tokens: torch.Tensor) -> None:
        dist.barrier()
        start = time.perf_counter()
        self.step(tokens)
        self.times.append(time.perf_counter() - start)

    def measure(self, tokens: torch.Tensor) -> None:
        tracker = MemTracker()
        tracker.track_external(self.model, self.optimizer)
        with tracker:
            self.step(tokens)
        peak = sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
        peak_t = torch.tensor([peak], dtype=torch.float64)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        self.peak_bytes = int(peak_t.item())
        with CommDebugMode() as mode:
            self.step(tokens)
        self.collectives = {str(op).split(".")[-1]: n for op, n in sorted(mode.get_comm_counts().items(), key=str)}


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    cfg = LlamaConfig(dim=args.dim, num_layers=args.layers, hidden_dim=args.dim * 8 // 3, max_seq_len=args.seq_len)
    raf = {"default": None, "true": True, "false": False}[args.reshard_after_forward]
    sides = [Side("fsdp_graph", fully_shard, cfg, raf), Side("FSDP2", torch_fully_shard, cfg, raf)]
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]

    for i in range(args.warmup):
        for side in sides:
            side.step(batches[i % len(batches)])
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else reversed(sides):  # alternate who goes first
            side.timed_step(batches[i % len(batches)])
    for side in sides:
        side.measure(batches[0])

    if rank == 0:
        num_params = sum(p.numel() for p in sides[0].model.parameters())
        print(f"Llama {args.layers} blocks, dim {args.dim}, {num_params / 1e6:.1f}M params, batch "
              f"{args.batch_size}x{args.seq_len} per rank, {world_size} gloo ranks, {args.rounds} rounds")
        print(f"{'':12}{'step ms (median)':>18}{'peak MiB':>10}  collectives per step")
        for side in sides:
            print(f"{side.name:12}{1e3 * statistics.median(side.times):>18.1f}"
                  f"{side.peak_bytes / 2**20:>10.2f}  {side.collectives}")
        ours, theirs = sides
        print(f"ratios fsdp_graph/FSDP2: step {statistics.median(ours.times) / statistics.median(theirs.times):.3f}, "
              f"heap {ours.peak_bytes / theirs.peak_bytes:.3f}, "
              f"collectives equal: {ours.collectives == theirs.collectives}", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


if __name__ == "__main__":
    main()
