"""torch 2.13: FSDP2 + sequence-parallel tensor parallelism, compiled with torch.compile(model), fails.

Torch alone (no fsdp_graph). A 2x2 gloo mesh (dp x tp): an embedding rowwise-parallel with its
output sharded on the sequence, two blocks (LayerNorm on sequence shards, an MLP column- then
rowwise-parallel back to sequence shards), a LayerNorm and a head; torch's `fully_shard` on each
block and the root over dp; `torch.compile(model, backend="aot_eager")`:

    python examples/repro/fsdp2_sequence_parallel_compile.py              # fails on every rank
    python examples/repro/fsdp2_sequence_parallel_compile.py --no-fsdp    # the same without FSDP: clean

On torch 2.13.0+cpu every rank raises `BackendCompilerFailed` ("AssertionError: Mixing fake modes
NYI"; on tests/test_tensor_parallel.py's model the traceback ends in DTensor's redistribute of the
embedding's output while AOTAutograd traces the embedding). Without `fully_shard`, or with it on
the root alone and no blocks, it compiles. fsdp_graph's compile scope "block" (and
`torch.compile(model)` with a backend not ours) runs its groups as FSDP2 does and fails the same
way; its default whole-step graph compiles this model (docs/compiler.md, Known limits).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

VOCAB, DIM, HIDDEN = 30, 16, 36


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def run(rank: int, world_size: int, port: int, use_fsdp: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "norm": SequenceParallel(),
            "up": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "down": RowwiseParallel(output_layouts=Shard(1)),
        })
        parallelize_module(block.up, mesh["tp"], ColwiseParallel())
    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    if use_fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    tokens = torch.randint(0, VOCAB, (2, 6))
    try:
        logits = torch.compile(model, backend="aot_eager")(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        print(f"rank {rank}: compiled and ran", flush=True)
    except Exception as error:  # report every rank's failure, then exit cleanly
        first = next((line for line in str(error).splitlines() if "Error" in line), str(error).splitlines()[0])
        print(f"rank {rank}: {type(error).__name__}: {first[:200]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(4, 29541, "--no-fsdp" not in sys.argv), nprocs=4)
