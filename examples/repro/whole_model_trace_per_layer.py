"""torch 2.13, torch alone (no fsdp_graph): what tracing a whole model costs per layer, with aot_eager.

Not a fault of torch's: a measurement behind fsdp_graph's compile-cost figures (docs/benchmarks.md,
"What a layer costs to trace"). A stack of plain decoder blocks (RMSNorm, attention, SwiGLU MLP; no
sharding, no communication), one process, `torch.compile(model, backend="aot_eager")`, the first
forward and backward timed, at two depths:

    python examples/repro/whole_model_trace_per_layer.py                 # inline, regions, fsdp2; 4 and 16 layers
    python examples/repro/whole_model_trace_per_layer.py --modes inline --layers 4,8,16

Modes: `inline` (the blocks traced into one graph, as any whole-model graph holds them), `regions`
(each block's forward a `torch.compiler.nested_compile_region`: traced once, its later calls reused)
and `fsdp2` (torch's `fully_shard` on each block and the root, on a one-rank gloo group: Dynamo breaks
the graph at FSDP2's hooks and compiles one block graph that every block reuses). Per mode: the first
step's seconds at each depth and the seconds each further layer adds, with the phases of
`torch._dynamo.utils.compile_times()` (its `compilation_time_metrics`) that grow with depth (Dynamo's bytecode tracing, AOTAutograd's
metadata pass and joint trace).

What a whole-model graph pays per layer here is Dynamo's and AOTAutograd's work on that layer's ops;
a graph per block pays it once.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, 3 * dim, bias=False)
        self.w2 = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (m(h).view(b, s, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class RegionBlock(Block):
    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Model(nn.Module):
    def __init__(self, layers: int, block: type, dim: int = 128, vocab: int = 256) -> None:
        super().__init__()
        self.layers = nn.ModuleList(block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).logsumexp(-1).mean()


PHASES = ("bytecode_tracing", "aot_collect_metadata", "aot_trace_joint_graph")


def first_step(mode: str, layers: int) -> tuple[float, dict]:
    """Seconds of the first compiled forward and backward, and the phases' seconds."""
    torch._dynamo.reset()
    torch._dynamo.utils.compilation_time_metrics.clear()
    torch.manual_seed(0)
    model = Model(layers, RegionBlock if mode == "regions" else Block)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 64, 128)
    start = time.perf_counter()
    compiled(x).backward()
    seconds = time.perf_counter() - start
    return seconds, {p: sum(torch._dynamo.utils.compilation_time_metrics.get(p, [])) for p in PHASES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="inline,regions,fsdp2")
    parser.add_argument("--layers", default="4,16", help="comma-separated depths; per layer is read from the first and last")
    args = parser.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    first_step("inline", 1)  # the process's first compile pays one-time costs: not any row's
    print(f"torch {torch.__version__}; first step seconds (aot_eager), and what each layer adds from {depths[0]} to {depths[-1]}")
    for mode in args.modes.split(","):
        runs = {layers: first_step(mode, layers) for layers in depths}
        (s0, p0), (s1, p1) = runs[depths[0]], runs[depths[-1]]
        per_layer = (s1 - s0) / (depths[-1] - depths[0])
        phases = ", ".join(f"{p} {(p1[p] - p0[p]) / (depths[-1] - depths[0]):.3f}" for p in PHASES)
        steps = ", ".join(f"{layers} layers {runs[layers][0]:.2f} s" for layers in depths)
        print(f"{mode:8s} {steps}; per layer {per_layer:.3f} s ({phases})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
