"""Torch alone: a reduce-scatter on gloo, as gloo runs it and as an all-to-all of the rows and their sum.

Gloo has no reduce-scatter: `reduce_scatter_tensor` clones the bucket, all-reduces the clone (each
rank sends 2(W-1)/W of the bucket over the ring) and copies this rank's row out. An all-to-all of the
bucket's W rows sends (W-1)/W of it, after which each rank sums the W copies of its own row.
This times both (and the in-place all-reduce fsdp_graph's compiled graphs run) on buckets of
1, 4 and 16 MiB, and checks that the all-to-all's sums equal gloo's bit for bit on 2 ranks:

    torchrun --nproc-per-node 2 examples/repro/gloo_reduce_scatter_bytes.py

fsdp_graph's compiled graphs reduce-scatter on gloo as the in-place all-reduce: what goes on the wire
must stay gloo's own, which a rank on the eager hooks sends ([Note: Reduce-scatters on gloo] in
passes/gloo.py). A benchmark, not a test: it asserts only the sums.
"""

import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    for numel in (1 << 18, 1 << 20, 1 << 22):
        bucket = torch.randn(numel)

        def gloo_reduce_scatter():
            out = torch.empty(numel // world)
            dist.reduce_scatter_tensor(out, bucket)
            return out

        def all_reduce_in_place():
            summed = bucket.clone()  # the graph all-reduces the bucket itself; the clone keeps `bucket` for the next call
            dist.all_reduce(summed)
            return summed.view(world, -1)[rank]

        def all_to_all_and_sum():
            received = torch.empty_like(bucket)
            dist.all_to_all_single(received, bucket)
            rows = received.view(world, -1)
            total = rows[0]
            for other in range(1, world):
                total = total + rows[other]
            return total

        ways = {"reduce_scatter_tensor": gloo_reduce_scatter, "all_reduce (in place)": all_reduce_in_place,
                "all_to_all + sum": all_to_all_and_sum}
        expected = gloo_reduce_scatter()
        for name, way in ways.items():
            if world == 2:
                assert torch.equal(way(), expected), name
            else:
                torch.testing.assert_close(way(), expected)
        for name, way in list(ways.items()) * 2:  # twice, in turns
            dist.barrier()
            began = time.perf_counter()
            for _ in range(20):
                way()
            took = torch.tensor((time.perf_counter() - began) / 20)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"{numel * 4 / 2**20:5.1f} MiB  {name:24s} {took.item() * 1e3:7.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
