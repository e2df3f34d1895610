"""Benchmark fsdp_graph against PyTorch's FSDP2 on the same Llama-style model, in one run.

CPU / gloo:
    torchrun --nproc-per-node 2 examples/benchmark.py                      # fp32 and ZeRO-2 rows
    torchrun --nproc-per-node 2 examples/benchmark.py --configs bf16 --dim 128 --seq-len 32
    torchrun --nproc-per-node 2 examples/benchmark.py --markdown eager.md   # also the table for docs/benchmarks.md

Configs: fp32 (FSDP2 defaults), zero2 (reshard_after_forward=False), bf16 (bf16 parameters, fp32
reduction; slow on CPUs without bf16 units, so use a smaller model), frozen (LoRA-style: each
block's attention and w1/w3 weights frozen, in the same groups as trainable ones; run it with fp32
to see the memory that freezing saves).

Both sides get the same model, data and optimizer. Steps alternate between them so drift in machine
load hits both alike. Per side it prints the median step time, the peak live tensor memory of one
step (torch's MemTracker, max over ranks; not with frozen parameters, which it cannot track), the
bytes of parameters, gradients and optimizer state per rank after backward, the collectives of one step (CommDebugMode), and the
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
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from llama import Llama, LlamaConfig, llama_config, shard_llama
from bench_report import init_cpu_ranks, write_markdown

from fsdp_graph import MixedPrecisionPolicy, fully_shard


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--configs", default="fp32,zero2", help="comma-separated: fp32, zero2, bf16, frozen")
    parser.add_argument("--markdown", metavar="FILE", help="also write the results as a markdown table, with date, machine and command")
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
    "frozen": ({}, {}),
}


def freeze_lora_style(model: Llama) -> None:
    """Freeze every block's attention projections and feed-forward w1/w3 (norms and w2 train)."""
    for name, p in model.named_parameters():
        if name.startswith("layers.") and (".attention." in name or ".w1." in name or ".w3." in name):
            p.requires_grad_(False)


class Side:
    """One implementation under test: its model, optimizer and measurements."""

    def __init__(self, name: str, shard_fn, cfg: LlamaConfig, shard_kwargs: dict, frozen: bool = False) -> None:
        self.name = name
        torch.manual_seed(0)
        model = Llama(cfg)
        if frozen:
            freeze_lora_style(model)
        self.model = shard_llama(model, shard_fn, **shard_kwargs)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.times: list[float] = []
        self.peak_bytes = 0
        self.collectives: dict[str, int] = {}

    def step(self, tokens: torch.Tensor, after_backward=None) -> float:
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        if after_backward is not None:
            after_backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def timed_step(self, tokens: torch.Tensor) -> None:
        dist.barrier()
        start = time.perf_counter()
        self.step(tokens)
        self.times.append(time.perf_counter() - start)

    def measure(self, tokens: torch.Tensor) -> None:
        self.peak_bytes = None  # torch 2.13's MemTracker cannot track frozen parameters
        if all(p.requires_grad for p in self.model.parameters()):
            tracker = MemTracker()
            tracker.track_external(self.model, self.optimizer)
            with tracker:
                self.step(tokens)
            self.peak_bytes = _max_over_ranks(sum(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values()))
        self.step(tokens, after_backward=self._measure_state)
        with CommDebugMode() as mode:
            self.step(tokens)
        self.collectives = {str(op).split(".")[-1]: n for op, n in sorted(mode.get_comm_counts().items(), key=str)}


    def _measure_state(self) -> None:
        """Bytes of this rank's parameters, gradients and optimizer state, after backward (max over ranks)."""
        def local_bytes(t):
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        total = 0
        for p in self.model.parameters():
            total += local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0)
        for state in self.optimizer.state.values():
            total += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v))
        self.state_bytes = _max_over_ranks(total)


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_config(name: str, args, cfg: LlamaConfig, batches: list) -> list[Side]:
    ours_kwargs, theirs_kwargs = CONFIGS[name]
    frozen = name == "frozen"
    sides = [
        Side("fsdp_graph", fully_shard, cfg, ours_kwargs, frozen),
        Side("FSDP2", torch_fully_shard, cfg, theirs_kwargs, frozen),
    ]
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
    print(f"{'':12}{'step ms (median)':>18}{'peak MiB':>10}{'state MiB':>11}  collectives per step")
    for side in sides:
        peak = "n/a" if side.peak_bytes is None else f"{side.peak_bytes / 2**20:.2f}"
        print(f"{side.name:12}{1e3 * statistics.median(side.times):>18.1f}{peak:>10}"
              f"{side.state_bytes / 2**20:>11.2f}  {side.collectives}")
    ours, theirs = sides
    heap = "n/a" if ours.peak_bytes is None else f"{ours.peak_bytes / theirs.peak_bytes:.3f}"
    print(f"ratios fsdp_graph/FSDP2: step {statistics.median(ours.times) / statistics.median(theirs.times):.3f}, "
          f"heap {heap}, state {ours.state_bytes / theirs.state_bytes:.3f}, "
          f"collectives equal: {ours.collectives == theirs.collectives}", flush=True)


def write_markdown_report(args, cfg: LlamaConfig, world_size: int, results: dict[str, list[Side]]) -> str:
    """The rows `report` prints, one per config, as docs/benchmarks.md's eager table."""
    rows = []
    for name, (ours, theirs) in results.items():
        step_ours, step_theirs = statistics.median(ours.times), statistics.median(theirs.times)
        peak = "n/a" if ours.peak_bytes is None else f"{ours.peak_bytes / 2**20:.2f} / {theirs.peak_bytes / 2**20:.2f}"
        counts = [", ".join(f"{n} {op}" for op, n in side.collectives.items()) for side in (ours, theirs)]
        collectives = counts[0] if counts[0] == counts[1] else f"{counts[0]} / {counts[1]}"
        rows.append([name, f"{1e3 * step_ours:.1f}", f"{1e3 * step_theirs:.1f}", f"{step_ours / step_theirs:.3f}", peak,
                     f"{ours.state_bytes / 2**20:.2f} / {theirs.state_bytes / 2**20:.2f}", collectives])
    header = ["config", "fsdp_graph ms", "FSDP2 ms", "step ratio", "peak MiB (ours / FSDP2)",
              "state MiB (ours / FSDP2)", "collectives per step"]
    caption = (f"Llama {args.layers} blocks, dim {args.dim}, batch {args.batch_size}x{args.seq_len} per rank, "
               f"{world_size} gloo ranks, median of {args.rounds} alternating steps.")
    return write_markdown(args.markdown, "Eager runtime vs FSDP2", [(caption, header, rows)])


def main() -> None:
    args = parse_args()
    rank, world_size = init_cpu_ranks()
    cfg = llama_config(args.dim, args.layers, args.seq_len)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]
    if rank == 0:
        num_params = sum(p.numel() for p in Llama(cfg).parameters())
        print(f"Llama {args.layers} blocks, dim {args.dim}, {num_params / 1e6:.1f}M params, batch "
              f"{args.batch_size}x{args.seq_len} per rank, {world_size} gloo ranks, {args.rounds} rounds")
    results = {}
    for name in args.configs:
        results[name] = run_config(name, args, cfg, batches)
        if rank == 0:
            report(name, results[name])
    if rank == 0 and "fp32" in results and "frozen" in results:
        for full, frozen in zip(results["fp32"], results["frozen"]):
            saved = full.state_bytes - frozen.state_bytes
            print(f"freezing saves ({full.name}): parameters + gradients + optimizer state per rank "
                  f"{full.state_bytes / 2**20:.2f} -> {frozen.state_bytes / 2**20:.2f} MiB "
                  f"(-{saved / 2**20:.2f} MiB, -{100 * saved / full.state_bytes:.1f}%)")
    if rank == 0 and args.markdown:
        print(f"markdown: {write_markdown_report(args, cfg, world_size, results)}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # see train_llama.py: torch 2.13's gloo teardown can abort


if __name__ == "__main__":
    main()
