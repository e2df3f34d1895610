"""How many times Dynamo's trace of one sharded block's call moves between the library's folders.

Run: python tools/traced_call_walk.py [--regions marked|blocks]
One process on the fake process group (world 2): a three-block model, every block and the root
sharded, traced by Dynamo for a capture-only backend with the fsdp_graph backend's step scope (what
`torch.compile(model, backend="fsdp_graph")` traces, without compiling it). Dynamo's `trace_source`
log names every source line it traces; the lines of the second block's call (from its
`FSDPModule.__call__` to the next line of the model's own forward: pre-forward, the block's
forward, post-forward) are reduced to the library
folders they lie in (fsdp_graph/api, traced, runtime, ...), and each change of folder counts as a
move. docs/layout.md records the figures.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_graph
from fsdp_graph import fully_shard

_LIBRARY = Path(fsdp_graph.__file__).resolve().parent.parent  # the checkout (editable install)
_LINE = re.compile(r"TRACE starts_line (\S+):(\d+) in (\S+)(.*)")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def traced_lines(regions: str) -> list[tuple[str, str]]:
    """(file, function and qualified names) of every line Dynamo traces in one step of the model."""
    lines: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = _LINE.search(record.getMessage())
            if match:
                lines.append((match.group(1), match.group(3) + match.group(4)))

    def capture(gm, example_inputs):
        return gm.forward

    capture.fsdp_graph_scope = "step"  # as the fsdp_graph backend's default scope
    capture.fsdp_graph_regions = regions
    model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    torch._logging.set_logs(trace_source=True)
    handler = Collect()
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        torch.compile(model, backend=capture)(torch.randn(4, 16))
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
        torch._logging.set_logs()
    return lines


def folder_of(path: str) -> str | None:
    """The library folder `path` lies in, or None outside the library (torch, the model)."""
    try:
        relative = Path(path).resolve().relative_to(_LIBRARY)
    except ValueError:
        return None
    if relative == Path(__file__).resolve().relative_to(_LIBRARY):
        return None  # the model above
    return str(relative.parent)


def block_call(lines: list[tuple[str, str]], which: int = 1) -> list[str]:
    """The library folders, line by line, of block `which`'s call."""
    starts = [i for i, (path, fn) in enumerate(lines)
              if fn.startswith("FSDPBlock.__call__") and (i == 0 or not lines[i - 1][1].startswith("FSDPBlock.__call__"))]
    start = starts[which]
    end = next(i for i in range(start + 1, len(lines)) if "(Model.forward)" in lines[i][1] or i in starts)
    return [folder for folder in (folder_of(path) for path, _ in lines[start:end]) if folder is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--regions", default="marked", choices=["marked", "blocks"])
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    folders = block_call(traced_lines(args.regions))
    path = [folders[0]] + [b for a, b in zip(folders, folders[1:]) if a != b]
    print(f"lines traced in the library: {len(folders)}; folder moves: {len(path) - 1}")
    print(" -> ".join(path))


if __name__ == "__main__":
    main()
