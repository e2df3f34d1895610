"""Benchmark fsdp_graph against PyTorch's FSDP2 on the same Llama-style model, in one run.

CPU / gloo:
    torchrun --nproc-per-node 2 examples/benchmark.py                      # fp32 and ZeRO-2 rows
    torchrun --nproc-per-node 2 examples/benchmark.py --configs bf16 --dim 128 --seq-len 32

Configs: fp32 (FSDP2 defaults), zero2 (reshard_after_forward=False), bf16 (bf16 parameters, fp32
reduction; slow on CPUs without bf16 units, so use a smaller model).

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
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from llama import Llama, LlamaConfig, shard_llama

from fsdp_graph import MixedPrecisionPolicy, fully_shard


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--configs", default="fp32,zero2", help="comma-separated: fp32, zero2, bf16")
    args = parser.parse_args()
    args.configs = args.configs.split(",")
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {sorted(CONFIGS)}")
    return args


# name -> (fully_shard kwargs for fsdp_graph, the same for FSDP2)
CONFIGS = {
    "fp32": ({}, {}),
    "zero2": ({"reshard_after_forward": False}, {"reshard_after_forward": False}),
    "bf16": (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
        {"mp_policy": TorchMixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
    ),
}


class Side:
    """One implementation under test: its model, optimizer and measurements."""

    def __init__(self, name: str, shard_fn, cfg: LlamaConfig, shard_kwargs: dict) -> None:
        self.name = name
        torch.manual_seed(0)
        self.model = shard_llama(Llama(cfg), shard_fn, **shard_kwargs)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.peak_bytes = 0
        self.collectives: dict[str, int] = {}

    def step(self, tokens: torch.Tensor) -> float:
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
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


def run_config(name: str, args, cfg: LlamaConfig, batches: list) -> list[Side]:
    ours_kwargs, theirs_kwargs = CONFIGS[name]
    sides = [Side("fsdp_graph", fully_shard, cfg, ours_kwargs), Side("FSDP2", torch_fully_shard, cfg, theirs_kwargs)]
    for i in range(args.warmup):
        for side in sides:
            side.step(batches[i % len(batches)])
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else reversed(sides):  # alternate who goes first
            side.timed_step(batches[i % len(batches)])
    for side in sides:
        side.measure(batches[0])
    return sides


def report(name: str, sides: list[Side]) -> None:
    print(f"[{name}]")
    print(f"{'':12}{'step ms (median)':>18}{'peak MiB':>10}  collectives per step")
    for side in sides:
        print(f"{side.name:12}{1e3 * statistics.median(side.times):>18.1f}"
              f"{side.peak_bytes / 2**20:>10.2f}  {side.collectives}")
    ours, theirs = sides
    print(f"ratios fsdp_graph/FSDP2: step {statistics.median(ours.times) / statistics.median(theirs.times):.3f}, "
          f"heap {ours.peak_bytes / theirs.peak_bytes:.3f}, "
          f"collectives equal: {ours.collectives == theirs.collectives}", flush=True)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    cfg = LlamaConfig(dim=args.dim, num_layers=args.layers, hidden_dim=args.dim * 8 // 3, max_seq_len=args.seq_len)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]
    if rank == 0:
        num_params = sum(p.numel() for p in Llama(cfg).parameters())
        print(f"Llama {args.layers} blocks, dim {args.dim}, {num_params / 1e6:.1f}M params, batch "
              f"{args.batch_size}x{args.seq_len} per rank, {world_size} gloo ranks, {args.rounds} rounds")
    for name in args.configs:
        sides = run_config(name, args, cfg, batches)
        if rank == 0:
            report(name, sides)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


if __name__ == "__main__":
    main()
