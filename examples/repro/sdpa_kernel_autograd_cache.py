"""torch 2.13: a compiled graph that enters `torch.nn.attention.sdpa_kernel` is never served by
AOTAutogradCache.

Torch alone (no fsdp_graph). Dynamo bakes the context manager into the graph as calls of
`torch.nn.attention._backend_from_string` and `torch.nn.attention._sdpa_kernel`
(`SDPAKernelVariable` in torch/_dynamo/variables/ctx_manager.py), and AOTAutogradCache accepts only
call_function targets it knows to be safe, which these two private helpers are not. This script
compiles a small attention module with Inductor twice, each in a fresh process over one cache
directory, and prints AOTAutogradCache's counters of the second:

    python examples/repro/sdpa_kernel_autograd_cache.py            # sdpa_kernel(MATH) in forward: bypassed
    python examples/repro/sdpa_kernel_autograd_cache.py --marked   # the two helpers marked cacheable: a hit
    python examples/repro/sdpa_kernel_autograd_cache.py --plain    # no sdpa_kernel: a hit

On torch 2.13.0+cpu the first gives `autograd_cache_bypass` in both processes (the log: "Bypassing
autograd cache due to: Unsupported call_function target <function _backend_from_string ...>"), so a
relaunch traces and partitions the whole graph again; the other two give `autograd_cache_hit` in the
second. torchtitan's attention enters `sdpa_kernel` in every block. Both helpers are pure functions
of the constants the graph passes them (a backend's name; the backends and a flag), which the
graph's code, part of the key, holds. fsdp_graph's backend marks them cacheable while it compiles
such a graph ([Note: sdpa_kernel in a cached graph] in fsdp_graph/compile/cache_key.py).
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HELPERS = ("torch.nn.attention._backend_from_string", "torch.nn.attention._sdpa_kernel")


class Attention(nn.Module):
    def __init__(self, plain: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.plain = plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.plain:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def child(mode: str) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Attention(plain=mode == "--plain")
    patches = {"unsafe_marked_cacheable_functions": {name: torch.__version__ for name in HELPERS}} if mode == "--marked" else {}
    with torch._inductor.config.patch(patches):
        torch.compile(model)(torch.randn(2, 8, 16)).backward()
    print(json.dumps(dict(counters["aot_autograd"])))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    mode = sys.argv[1] if len(sys.argv) > 1 else "--sdpa-kernel"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for launch in ("first", "second"):
            out = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True, text=True, check=True)
            print(f"{launch} process, {mode}: {out.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
