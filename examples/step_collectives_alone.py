"""Torch alone: what one training step's FSDP collectives cost on this machine, with nothing else running.

The model of examples/benchmark_graph_trainer.py (torchtitan's llama3 debug model, 6 layers) sharded as
its rows shard it: each block one bucket, the rest of the model (embedding, norm, output) one more.
On 2 gloo ranks, each step all-gathers every bucket in forward, then in backward, block by block from
the last, all-gathers it again (a group that reshards after forward) and reduces its gradient bucket
as gloo's reduce-scatter does it (an all-reduce of the whole bucket: what FSDP2, graph_trainer and
fsdp_graph send, [Note: Reduce-scatters on gloo]) and as an all-to-all of the bucket's rows would
(half the bytes on 2 ranks). Without the re-gathers: selective unsharding keeping every group. No
compute, no copies in or out: the wire and gloo's own work only. A step's time is its slower rank's;
the median of `--steps` after 2 warm-up.

On a machine where both ranks' compute takes every core (this one: 2 cores, 2 ranks), the collectives
cannot run beside the compute for free: this is what a sharded step adds to the no-communication
floor unless it hides under compute (docs/benchmarks.md, issue #81).

    torchrun --nproc-per-node 2 examples/step_collectives_alone.py
It imports no fsdp_graph code. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def bucket_sizes(layers: int, seq: int) -> list[int]:
    """The elements of each bucket: the root's, then each block's."""
    import benchmark_graph_trainer as bench  # the model builders only (they import no fsdp_graph code)
    import torchtitan_on_cpu

    torchtitan_on_cpu.prepare()
    model = bench.plain_model(bench.graph_trainer_config(argparse.Namespace(layers=layers, seq=seq, warmup=1, steps=1)), 0)
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = bucket_sizes(args.layers, 1024)
    shards = [torch.randn(-(-n // world)) for n in sizes]
    grads = [torch.randn(s.numel() * world) for s in shards]

    def gather(i: int) -> None:
        dist.all_gather_into_tensor(torch.empty(shards[i].numel() * world), shards[i])

    def reduce(i: int, all_to_all: bool) -> None:
        if all_to_all:
            dist.all_to_all_single(torch.empty_like(grads[i]), grads[i])
        else:
            dist.all_reduce(grads[i].clone())

    def step(regather: bool, all_to_all: bool) -> None:
        for i in range(len(sizes)):
            gather(i)
        for i in reversed(range(len(sizes))):
            if regather and i > 0:  # the root reshards not after forward, as fully_shard's root
                gather(i)
            reduce(i, all_to_all)

    if rank == 0:
        print(f"{world} ranks, {len(sizes)} buckets, {sum(sizes) * 4 / 2**20:.1f} MiB of fp32 parameters")
    cases = [(regather, all_to_all, f"{what}, gradients {how}")
             for all_to_all, how in ((False, "all-reduced"), (True, "by all-to-all"))
             for regather, what in ((True, "every block gathered again in backward"), (False, "no block gathered again"))]
    for regather, all_to_all, what in cases:
        times = []
        for _ in range(2 + args.steps):
            dist.barrier()
            began = time.perf_counter()
            step(regather, all_to_all)
            times.append(time.perf_counter() - began)
        slowest = torch.tensor(times[2:], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"{what}: median {statistics.median(slowest.tolist()) * 1e3:.1f} ms, "
                  f"min {min(slowest.tolist()) * 1e3:.1f} ms, max {max(slowest.tolist()) * 1e3:.1f} ms per step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
