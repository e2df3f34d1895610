"""What gloo allocates for a collective besides its output, between issuing it and waiting on it.

Torch alone (no fsdp_graph). Each rank issues one functional collective of a 4 MiB fp32 tensor, as a
compiled FSDP step does, and a thread samples glibc's in-use heap bytes (mallinfo2) while it runs;
then the heap is read again just before and just after the wait:

    torchrun --nproc-per-node 2 examples/repro/gloo_collective_scratch.py

On torch 2.13.0+cpu (2 ranks on one machine) it prints, in MiB above the level before the issue:

    op                                output  peak in flight  before wait  after wait
    all_gather_into_tensor_out        4.00    8.00            4.00         4.00
    reduce_scatter_tensor             2.00    8.00            6.00         2.00
    all_reduce                        4.00    6.00            4.00         4.00

So gloo's all-gather holds a copy of its output while the transfer runs, and its reduce-scatter a
copy of its whole input until the wait plus one of its output while it runs (the all-reduce, which
FSDP does not issue, half its output while it runs). fsdp_graph's simulator
counts both, until the wait (`_gloo_scratch_bytes` in passes/simulator.py): a schedule that keeps
several collectives in flight on gloo holds these too, and a memory budget must see them.
"""

import ctypes
from contextlib import contextmanager
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  registers torch.ops._c10d_functional


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def in_use() -> int:
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def one_malloc_arena() -> None:
    """Have every thread of this process allocate from glibc's one main arena, so that `in_use` is
    one consistent reading. Call it before any other thread starts (here: before the process group,
    whose gloo threads allocate). With an arena per thread, mallinfo2 locks and reads the arenas one
    after another: a buffer one thread frees after its arena was read, while another thread
    allocates one in an arena read later, is counted twice. Gloo's all-gather frees a temporary
    output-sized tensor on the issuing thread just as its worker thread allocates its own, so now and
    then a sample showed three outputs' worth of heap that never was (docs/benchmarks.md, "Figures
    behind the code's notes")."""
    M_ARENA_MAX = -8
    _libc.mallopt(M_ARENA_MAX, 1)


@contextmanager
def heap_peak():
    """Yields a one-item list that holds, once the block ends, the most in-use heap bytes above the
    level at entry seen meanwhile (a thread samples it without pause)."""
    base = in_use()
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], in_use() - base)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def measure(issue) -> tuple[float, float, float, float]:
    """(output, peak while in flight, before the wait, after the wait), MiB above the level before."""
    dist.barrier()
    base = in_use()
    with heap_peak() as peak:
        out = issue()
        time.sleep(0.05)  # the transfer finishes meanwhile
    before = in_use() - base
    torch.ops._c10d_functional.wait_tensor(out)
    after = in_use() - base
    return tuple(x / 2**20 for x in (out.numel() * out.element_size(), peak[0], before, after))


def main() -> None:
    one_malloc_arena()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    numel = 1 << 20
    x = torch.ones(numel)
    ops = {
        "all_gather_into_tensor_out": lambda: torch.ops._c10d_functional.all_gather_into_tensor_out(
            x[: numel // world], world, group, out=torch.empty(numel)),
        "reduce_scatter_tensor": lambda: torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", world, group),
        "all_reduce": lambda: torch.ops._c10d_functional.all_reduce(x, "sum", group),
        "all_reduce_ (in place)": lambda: torch.ops._c10d_functional.all_reduce_(x, "sum", group),
    }
    if dist.get_rank() == 0:
        print(f"{'op':34}{'output':8}{'peak in flight':16}{'before wait':13}after wait")
    for name, issue in ops.items():
        for _ in range(2):  # the first call of each op warms gloo up
            figures = measure(issue)
        if dist.get_rank() == 0:
            print(f"{name:34}" + "".join(f"{v:<{w}.2f}" for v, w in zip(figures, (8, 16, 13, 0))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
