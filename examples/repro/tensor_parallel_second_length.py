"""Tensor parallel (no FSDP) compiled with torch.compile: the second sequence length fails.

Torch alone (no fsdp_graph). Two ranks of one tp group (gloo), a colwise/rowwise MLP and attention
block, `torch.compile(model, backend="aot_eager")`, one forward and backward per length:

    torchrun --nproc-per-node 2 examples/repro/tensor_parallel_second_length.py

torch 2.13.0+cpu: the first length (6) runs; the second (8), whose graph automatic dynamic shapes
make symbolic in the length, fails in AOTAutograd's joint trace with "RecursionError: maximum
recursion depth exceeded" (autograd's anomaly report names ViewBackward0). With `dynamic=False`
every length gets a static graph and runs. The same happens with torch's fully_shard on a 2-D mesh
and with ours (the whole-step graph): docs/composition.md, Known limits.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

DIM, HEADS = 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        return x + self.down(F.gelu(self.up(x)))


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = parallelize_module(Block(), mesh, {
        "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
        "up": ColwiseParallel(), "down": RowwiseParallel(),
    })
    run = torch.compile(model, backend="aot_eager", dynamic=False if "--static" in sys.argv else None)
    for length in (6, 8):
        try:
            run(torch.randn(4, length, DIM, generator=torch.Generator().manual_seed(length))).sum().backward()
            outcome = "ran"
        except Exception as e:  # noqa: BLE001 - the repro reports what torch raised
            cause = getattr(e, "inner_exception", e)  # Dynamo's BackendCompilerFailed wraps it
            outcome = f"failed: {type(cause).__name__}: {str(cause).splitlines()[0][:120]}"
        if dist.get_rank() == 0:
            print(f"length {length}: {outcome}", flush=True)
        if outcome != "ran":
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
