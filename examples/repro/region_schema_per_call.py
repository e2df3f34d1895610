"""Torch alone: AOTAutograd rebuilds a compile region's schema at every call of it.

Blocks whose forward is a `torch.compiler.nested_compile_region`: Dynamo traces the body once and
reuses it for every block, and AOTAutograd traces the body once too. But each call of the region
under autograd asks the op for its schema (`InvokeSubgraphHOP.gen_schema`, to refuse input
mutations in training), which traces the body again as a graph, once per call and per AOTAutograd
pass over the step. This counts those calls and their seconds against the depth.

    python examples/repro/region_schema_per_call.py            # 4 and 16 blocks, aot_eager
"""

import time

import torch
from torch import nn
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def main() -> None:
    calls, seconds = [0], [0.0]
    gen_schema = InvokeSubgraphHOP.gen_schema

    def counted(self, *args, **kwargs):  # measuring only: torch's own method, timed
        start = time.perf_counter()
        try:
            return gen_schema(self, *args, **kwargs)
        finally:
            calls[0] += 1
            seconds[0] += time.perf_counter() - start

    InvokeSubgraphHOP.gen_schema = counted
    for depth in (4, 16):
        torch._dynamo.reset()
        calls[0], seconds[0] = 0, 0.0
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(64) for _ in range(depth)])
        compiled = torch.compile(model, backend="aot_eager")
        start = time.perf_counter()
        compiled(torch.randn(8, 64)).sum().backward()
        total = time.perf_counter() - start
        print(f"{depth:3d} blocks: first step {total:5.2f} s, gen_schema called {calls[0]} times, {seconds[0]:5.2f} s")


if __name__ == "__main__":
    main()
