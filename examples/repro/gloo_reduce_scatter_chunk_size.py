"""gloo's reduce-scatter over 4 ranks: the bits of a sum depend on the size of each rank's chunk.

Torch alone (no fsdp_graph). Each rank reduce-scatters the same rows twice, once as they are and once
with a few zeros after each rank's chunk, and compares the sums of the rows:

    torchrun --nproc-per-node 4 examples/repro/gloo_reduce_scatter_chunk_size.py

On torch 2.13.0+cpu some elements differ by an ulp on ranks 1-3 (gloo adds the 4 ranks' rows in an
order that follows the chunk size). With 2 ranks every sum is equal: a + b is b + a. This is why
fsdp_graph's reduce-scatter, which carries a flag per parameter after the gradients, can land an
ulp away from torch's `fully_shard` on 4 gloo ranks (docs/frameworks/torchtitan.md).
"""

import torch
import torch.distributed as dist


def reduce_scatter_rows(rows: torch.Tensor, extra: int) -> torch.Tensor:
    """The sum over ranks of this rank's row of `rows`, reduce-scattered with `extra` zeros after each row."""
    world, width = rows.shape
    padded = torch.cat([rows, torch.zeros(world, extra)], dim=1).contiguous()
    out = torch.empty(width + extra)
    dist.reduce_scatter_tensor(out, padded.view(-1))
    return out[:width]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = torch.randn(world, 1 << 18, generator=torch.Generator().manual_seed(rank))
    plain, padded = reduce_scatter_rows(rows, 0), reduce_scatter_rows(rows, 7)
    differ = (plain != padded).sum().item()
    largest = (plain - padded).abs().max().item()
    print(f"rank {rank}: {differ} of {plain.numel()} sums differ (largest by {largest:.3g})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
