"""torch alone (no fsdp_graph): a `torch.compiler.nested_compile_region` whose body multiplies by a
module-level float that the script changes between steps. The first step compiles with the number as
a constant; the second compiles again with it unspecialized (an input tensor and its `.item()`), and
with torch 2.13.0 tracing the region fails there: "Freevar has no source: ... node.name=item" for a
region function called with the module as an argument after the first block ran inline (how
fsdp_graph's `regions="blocks"` calls blocks), "lift_tracked_freevar_to_input should not be called
on root SubgraphTracer" for a marked `forward`. Without the region (`--no-region`) every step
trains. This is why fsdp_graph traces such blocks inline ([Note: Numbers a region cannot take from
outside] in traced/kinds.py).

    python examples/repro/region_module_level_float.py                  # region function: AssertionError
    python examples/repro/region_module_level_float.py --marked-forward # marked forward: AssertionError
    python examples/repro/region_module_level_float.py --no-region      # every step runs
"""

import argparse

import torch
from torch import nn

SCALE = 1.0  # changed between steps, read by every block


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * SCALE


class MarkedBlock(Block):
    forward = torch.compiler.nested_compile_region(Block.forward)


@torch.compiler.nested_compile_region
def region(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return Block.forward(block, x)


class Stack(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList((MarkedBlock if how == "marked" else Block)() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):  # the first block inline, as fsdp_graph traces a kind's first
            x = region(block, x) if self.how == "function" and i > 0 else block(x)
        return x.sum()


def main() -> None:
    global SCALE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--marked-forward", action="store_true", help="mark Block.forward instead of a region function")
    parser.add_argument("--no-region", action="store_true", help="no nested_compile_region")
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    how = "none" if args.no_region else "marked" if args.marked_forward else "function"
    model = torch.compile(Stack(how), backend=args.backend)
    for step, scale in enumerate((1.0, 0.5, 2.0)):
        SCALE = scale
        loss = model(torch.randn(4, 8))
        loss.backward()
        print(f"step {step}: SCALE={scale} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
