"""Torch alone: a step with compile regions, once symbolic in a length, misses AOTAutogradCache on
every relaunch.

Three blocks whose forward is a `torch.compiler.nested_compile_region`, each with an output the
loss does not use, compiled with Inductor over two lengths: the second makes a graph symbolic in
the length. A relaunch on the same cache directory finds that graph's entry under the same key but
cannot load it: the entry pickles the backward graph, where the region's backward makes zeros for
the unused output (`aten.full([2, s, 2, 8], 0)`), and unpickling re-traces that code with a
Proxy in the op's int list, which the op refuses ("Expected a value of type 'List[int]'"; logged
as "fx graph cache unable to load compiled graph"). Without the region both graphs load.

    python examples/repro/region_symbolic_cache.py     # two launches each, with and without the region
"""

import json
import os
import subprocess
import sys
import tempfile

import torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor):
        h = self.lin(x)
        return h[..., :16].tanh(), h[..., 16:].view(x.shape[0], x.shape[1], 2, 8)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x, _ = block(x)  # the second output unused
        return x.sum()


def launch(region: bool) -> dict:
    """One launch: two lengths, forward and backward; AOTAutogradCache's counters."""
    from torch._dynamo.utils import counters

    if region:
        Block.forward = torch.compiler.nested_compile_region(Block.forward)
    torch.manual_seed(0)
    model = torch.compile(Net())
    for length in (8, 12):
        model(torch.randn(2, length, 16)).backward()
    return {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(launch(sys.argv[1] == "region")))
        return
    for kind in ("region", "plain"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp()}
        for attempt in ("launch", "relaunch"):
            done = subprocess.run([sys.executable, __file__, kind], env=env, capture_output=True, text=True, check=True)
            print(f"{kind:6s} {attempt:8s} {done.stdout.strip()}")


if __name__ == "__main__":
    main()
