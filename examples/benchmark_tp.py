"""Benchmark FSDP composed with tensor parallelism: fsdp_graph against torch's fully_shard.

CPU / gloo, 4 ranks as a (dp=2, tp=2) mesh, the example Llama with the usual tensor-parallel plan
(attention's wq/wk/wv and the MLP's w1/w3 column-wise, wo and w2 row-wise), then `fully_shard` over
dp per block and on the root:
    torchrun --nproc-per-node 4 examples/benchmark_tp.py
    torchrun --nproc-per-node 4 examples/benchmark_tp.py --dim 128 --layers 2 --rounds 4   # quicker

Rows: fsdp_graph eager, torch's fully_shard eager, and each compiled (fsdp_graph's backend; torch's
with Inductor). Steps alternate between the rows. Per row: median step time, ratio to torch's eager
composition, peak heap of one step (glibc's in-use bytes, sampled; max over ranks) and collectives
per step (gloo's profiler events). This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_compile import Row  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402

import fsdp_graph  # noqa: E402

BLOCK_PLAN = {
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row (the first compiles)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per data-parallel rank")
    parser.add_argument("--seq-len", type=int, default=128)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise ValueError("run with torchrun --nproc-per-node 4: a (dp=2, tp=2) mesh")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    cfg = LlamaConfig(vocab_size=256, dim=args.dim, num_layers=args.layers, num_heads=4,
                      hidden_dim=args.dim * 11 // 4, max_seq_len=args.seq_len + 1)

    def model(fully_shard):
        torch.manual_seed(0)
        llama = Llama(cfg)
        for block in llama.layers:
            parallelize_module(block, mesh["tp"], BLOCK_PLAN)
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(llama, mesh=mesh["dp"])

    rows = [
        Row("fsdp_graph eager", model(fsdp_graph.fully_shard)),
        Row("torch eager", model(torch_fully_shard)),
        Row("fsdp_graph compiled", model(fsdp_graph.fully_shard), "fsdp_graph"),
        Row("torch + compile", model(torch_fully_shard), "inductor"),
    ]
    # The ranks of one tp group see the same batch; the dp groups each their own.
    gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    batches = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen) for _ in range(4)]
    working = []
    for row in rows:
        try:
            for i in range(args.warmup):
                row.step(batches[i % len(batches)])
            working.append(row)
        except Exception as error:
            if rank == 0:
                print(f"{row.name}: failed ({type(error).__name__}: {str(error).splitlines()[0][:200]})")
    for i in range(args.rounds):
        for row in working if i % 2 == 0 else reversed(working):  # alternate who goes first
            row.timed_step(batches[i % len(batches)])
    for row in working:
        row.measure(batches[0])
    if rank == 0:
        reference = statistics.median(next(r for r in working if r.name == "torch eager").times)
        print(f"{'':22}{'step ms':>10}{'vs torch eager':>16}{'peak MiB':>11}  collectives per step")
        for row in working:
            median = statistics.median(row.times)
            print(f"{row.name:22}{median * 1e3:>10.1f}{median / reference:>16.3f}{row.peak:>11}  {row.collectives}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13's gloo teardown can abort (README, Known limits)


if __name__ == "__main__":
    main()
