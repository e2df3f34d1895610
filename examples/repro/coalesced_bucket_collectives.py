"""torch alone: one group's all-gather and reduce-scatter, as one flat rank-major bucket with its
copies, against per-parameter collectives coalesced into one param-major buffer (issue #48).

    torchrun --nproc-per-node 2 examples/repro/coalesced_bucket_collectives.py --dim 256

Flat: every rank's row holds its `Shard(0)` chunk of every parameter; one all-gather, then each
parameter is copied out of the gathered rows (its chunks lie a row apart), and the gradients are
packed into the reduce-scatter's input. Coalesced: each chunk is gathered straight into its
parameter's own slice of one buffer (`dist._coalescing_manager`), where the parameter is a view,
and each gradient is reduce-scattered from where it lies. Both give the same bytes (checked), and
the functional coalesced all-gather traces under `torch.compile(fullgraph=True)` (checked: the
compiled gather equals the eager one). Times are rank 0's medians over alternated rounds, in ms.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256, help="a Llama block's model dim (9 tensors)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(1)
    hidden = 4 * args.dim * 2 // 3
    hidden -= hidden % world
    shapes = [(args.dim, args.dim)] * 4 + [(hidden, args.dim), (hidden, args.dim), (args.dim, hidden), (args.dim,), (args.dim,)]
    numels = [torch.Size(s).numel() for s in shapes]
    chunk_numels = [n // world for n in numels]
    row = torch.randn(sum(chunk_numels), device=device)  # this rank's chunks, one after the other
    chunks = list(row.split(chunk_numels))
    grads = [torch.randn(s, device=device) for s in shapes]

    def flat_gather():
        gathered = torch.empty(world * row.numel(), device=device)
        dist.all_gather_into_tensor(gathered, row)
        params = [torch.empty(s, device=device) for s in shapes]
        for param, columns in zip(params, gathered.view(world, -1).split(chunk_numels, dim=1)):
            param.view(world, -1).copy_(columns)  # the copy-out
        return params

    def flat_gather_alone():
        gathered = torch.empty(world * row.numel(), device=device)
        dist.all_gather_into_tensor(gathered, row)

    def coalesced_gather():
        slices = torch.empty(sum(numels), device=device).split(numels)
        with dist._coalescing_manager(async_ops=True) as manager:
            for out, chunk in zip(slices, chunks):
                dist.all_gather_into_tensor(out, chunk)
        manager.wait()
        return [out.view(s) for out, s in zip(slices, shapes)]

    def flat_reduce():
        packed = torch.cat([g.view(world, -1) for g in grads], dim=1)  # the packing
        out = torch.empty(row.numel(), device=device)
        dist.reduce_scatter_tensor(out, packed.view(-1))
        return out

    def flat_reduce_alone():
        out = torch.empty(row.numel(), device=device)
        dist.reduce_scatter_tensor(out, torch.empty(world * row.numel(), device=device))

    def coalesced_reduce():
        out = torch.empty(row.numel(), device=device)
        with dist._coalescing_manager(async_ops=True) as manager:
            for slot, grad in zip(out.split(chunk_numels), grads):
                dist.reduce_scatter_tensor(slot, grad.view(-1))
        manager.wait()
        return out

    same_gathered = all(torch.equal(a, b) for a, b in zip(flat_gather(), coalesced_gather()))
    same_reduced = torch.allclose(flat_reduce(), coalesced_reduce())

    def traced(first, second):
        outs = torch.ops._c10d_functional.all_gather_into_tensor_coalesced([first, second], world, dist.group.WORLD.group_name)
        return [torch.ops._c10d_functional.wait_tensor(t) * 2 for t in outs]

    compiled = torch.compile(traced, fullgraph=True)(chunks[0], chunks[-1])
    traces = all(torch.equal(c, 2 * p.view(-1)) for c, p in zip(compiled, [coalesced_gather()[0], coalesced_gather()[-1]]))

    rows = (("flat gather (with copy-out)", flat_gather), ("flat all-gather alone", flat_gather_alone),
            ("coalesced gather", coalesced_gather), ("flat reduce (with packing)", flat_reduce),
            ("flat reduce-scatter alone", flat_reduce_alone), ("coalesced reduce", coalesced_reduce))
    times = {name: [] for name, _ in rows}
    for i in range(args.rounds):
        for name, run in (rows if i % 2 else rows[::-1]):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(f"dim {args.dim}: {sum(numels) / 1e6:.2f}M parameters in {len(shapes)} tensors, {world} ranks, {dist.get_backend()}; "
              f"same gathered {same_gathered}, same reduced {same_reduced}, coalesced gather traced {traces}")
        for name, seconds in times.items():
            seconds = seconds[10:]
            print(f"  {name:28} median {1e3 * statistics.median(seconds):8.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
