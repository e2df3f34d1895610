"""torch 2.13's gloo corrupts the heap with two or more all-gathers of one process group in flight.

Torch alone (no fsdp_graph). Each rank keeps up to K all-gathers in flight, as a compiled FSDP
step's prefetch does, with some compute between issuing and waiting:

    torchrun --nproc-per-node 2 examples/repro/gloo_all_gathers_in_flight.py              # aborts
    torchrun --nproc-per-node 2 examples/repro/gloo_all_gathers_in_flight.py --in-flight 1  # clean
    torchrun --nproc-per-node 2 examples/repro/gloo_all_gathers_in_flight.py --op plain     # clean

On torch 2.13.0+cpu (2 ranks on one machine) `--op functional` or `--op coalesced` aborts within
seconds to a minute with "malloc(): unaligned tcache chunk detected", "malloc_consolidate(): unaligned
fastbin chunk detected" or SIGSEGV. Both go through gloo's `allgather_coalesced` work (the functional
`all_gather_into_tensor`, what a traced graph calls, is `allgather_into_tensor_coalesced` on gloo).
Clean in the same loop: `--in-flight 1`, `--gloo-threads 1`, `--op plain` (`all_gather_single` with
async_op=True: gloo's plain allgather, what fsdp_graph's eager runtime calls), `--op out` (the
functional `all_gather_into_tensor_out`, which calls the plain allgather too), `--op all_reduce` and
`--op reduce_scatter` (functional). One all-gather beside one reduce-scatter (`--op alternate
--in-flight 2`) ran 40000 collectives clean here, yet a compiled step with that schedule aborted once.
fsdp_graph's compiled graphs therefore gather with `all_gather_into_tensor_out` on gloo ([Note:
All-gathers on gloo] in passes/gloo.py).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  registers torch.ops._c10d_functional

FUNCTIONAL = torch.ops._c10d_functional
# The bucket sizes (elements) of examples/train_llama.py's groups: the root, then four blocks.
BUCKET_NUMELS = [32835, 98505, 98505, 98505, 98505]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="functional", choices=["functional", "coalesced", "plain", "out", "all_reduce", "reduce_scatter", "all_to_all",
                                 "alternate", "alternate_out", "alternate_all_to_all"],
                        help="alternate: functional all-gathers and reduce-scatters by turns, so with --in-flight 2 "
                        "one of each is in flight (fsdp_graph's schedule on gloo)")
    parser.add_argument("--in-flight", type=int, default=3, help="collectives issued before the oldest is waited on")
    parser.add_argument("--gloo-threads", type=int, default=0, help="gloo worker threads (0: torch's default, 2)")
    parser.add_argument("--steps", type=int, default=4000, help="rounds of 10 collectives (about 100 s)")
    return parser.parse_args()


def init_gloo(threads: int) -> None:
    """The default process group on gloo, with `threads` worker threads if not 0."""
    if not threads:
        dist.init_process_group("gloo")
        return
    import torch.distributed.distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo

    class _Check(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, gloo)

    class WithThreads(metaclass=_Check):  # init_process_group takes no gloo options in 2.13
        def __new__(cls, store, rank, size, timeout=None):
            options = gloo._Options()
            options._threads = threads
            options._devices = [gloo.create_default_device()]
            if timeout is not None:
                options._timeout = timeout
            return gloo(store, rank, size, options)

    c10d.ProcessGroupGloo = WithThreads
    try:
        dist.init_process_group("gloo")
    finally:
        c10d.ProcessGroupGloo = gloo


def issue(op: str, numel: int, world: int, group_name: str, turn: int):
    x = torch.randn(numel)
    if op.startswith("alternate"):
        second = "all_to_all" if op == "alternate_all_to_all" else "reduce_scatter"
        op = ("functional" if op == "alternate" else "out") if turn % 2 == 0 else second
    if op == "functional":
        return FUNCTIONAL.all_gather_into_tensor(x, world, group_name)
    if op == "coalesced":
        return dist.all_gather_coalesced([[torch.empty(numel)] for _ in range(world)], [x], async_op=True)
    if op == "out":  # the functional all_gather_into_tensor_out: gloo's plain allgather, waited by wait_tensor
        return FUNCTIONAL.all_gather_into_tensor_out(x, world, group_name, out=torch.empty(world * numel))
    if op == "plain":
        return dist.all_gather_single(torch.empty(world * numel), x, async_op=True)
    if op == "all_reduce":
        return dist.all_reduce(x, async_op=True)
    if op == "all_to_all":  # the functional all_to_all_single of a bucket in equal rows
        return FUNCTIONAL.all_to_all_single(torch.randn(world * numel), [numel] * world, [numel] * world, group_name)
    return FUNCTIONAL.reduce_scatter_tensor(torch.randn(world * numel), "sum", world, group_name)


def wait(handle) -> None:
    if isinstance(handle, torch.Tensor):
        FUNCTIONAL.wait_tensor(handle)
    else:
        handle.wait()


def main() -> None:
    args = parse_args()
    init_gloo(args.gloo_threads)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)  # ranks compute different amounts: they drift apart
    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(args.steps):  # no per-round sync: the ranks drift apart, as in training
        pending = []
        for turn, numel in enumerate(BUCKET_NUMELS * 2):
            pending.append(issue(args.op, numel, world, group_name, turn))
            if len(pending) >= args.in_flight:
                for _ in range(int(torch.randint(0, 8, (1,), generator=gen))):
                    a = torch.tanh(a @ a)
                wait(pending.pop(0))
        for handle in pending:
            wait(handle)
    if rank == 0:
        print(f"--op {args.op} --in-flight {args.in_flight} --gloo-threads {args.gloo_threads}: {args.steps} rounds "
              f"({args.steps * len(BUCKET_NUMELS) * 2} collectives) in {time.perf_counter() - start:.0f} s without error", flush=True)
    dist.barrier()
    os._exit(0)  # see examples/train_llama.py: gloo's teardown in torch 2.13 aborts now and then


if __name__ == "__main__":
    main()
