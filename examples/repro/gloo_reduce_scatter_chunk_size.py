"""gloo's reduce-scatter over more than 2 ranks: the bits of a sum depend on the length of the rows.

Torch alone (no fsdp_graph). Each rank reduce-scatters the same rows several times, once as they are
and then with a few zeros after each rank's row (1, 2, 3, 4, 7 and 8 columns), and compares the
sums of the original columns:

    torchrun --nproc-per-node 4 examples/repro/gloo_reduce_scatter_chunk_size.py   # or 3, 8

On torch 2.13.0+cpu an odd number of extra columns moves a few sums by an ulp (gloo adds the ranks'
rows in an order that follows where an element lies in the row); an even number moves none (also
in bf16: `--dtype bfloat16`). With 2 ranks every sum is equal: a + b is b + a. fsdp_graph's
reduce-scatter carries the gradient flags after the gradients, which FSDP2's does not: an even
number of flag columns ([Note: An even number of flag columns] in runtime/bucket_layout.py) keeps its
sums FSDP2's bit for bit on gloo.
"""

import argparse

import torch
import torch.distributed as dist


def reduce_scatter_rows(rows: torch.Tensor, extra: int) -> torch.Tensor:
    """The sum over ranks of this rank's row of `rows`, reduce-scattered with `extra` zeros after
    each row."""
    world, width = rows.shape
    padded = torch.cat([rows, rows.new_zeros(world, extra)], dim=1).contiguous()
    out = rows.new_empty(width + extra)
    dist.reduce_scatter_tensor(out, padded.view(-1))
    return out[:width]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    dtype = getattr(torch, parser.parse_args().dtype)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.randn(world, 1 << 18, generator=torch.Generator().manual_seed(rank)).to(dtype)
    plain = reduce_scatter_rows(rows, 0)
    for extra in (1, 2, 3, 4, 7, 8):
        padded = reduce_scatter_rows(rows, extra)
        differ = (plain != padded).sum().item()
        largest = (plain - padded).abs().max().item()
        print(f"rank {rank}, {extra} extra columns: {differ} of {plain.numel()} sums differ "
              f"(largest by {largest:.3g})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
