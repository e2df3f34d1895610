"""torch 2.13: a selective-checkpoint `context_fn` with a `cache_hash` still bypasses AOTAutogradCache
when it is a lambda or a local function.

Torch alone (no fsdp_graph). torch asks a user whose compiled graph holds selective activation
checkpointing to give the `context_fn` a `cache_hash` attribute, and bypasses AOTAutogradCache for
the graph without one. This script compiles a small checkpointed model with Inductor twice, each in
a fresh process over one cache directory, and prints AOTAutogradCache's counters of the second:

    python examples/repro/checkpoint_policy_cache_hash.py             # the context_fn a lambda: bypassed
    python examples/repro/checkpoint_policy_cache_hash.py --partial   # functools.partial of module-level code: a hit

On torch 2.13.0+cpu the lambda, `cache_hash` set, gives `autograd_cache_bypass` in both processes
(the log: "Failed to pickle cache key ... Can't pickle local object '...<lambda>'"): the key pickles
the context_fn itself, which sits in the checkpointed subgraph's `meta`. The partial gives
`autograd_cache_hit` in the second. torchtitan's selective checkpointing builds its context_fn as a
lambda over a local policy, so its graphs are never served even with a hash. fsdp_graph's backend
keys such a context_fn by its `cache_hash` ([Note: A checkpoint policy's cache_hash] in
fsdp_graph/compile/cache_key.py).
"""

import functools
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def save_matmuls(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    def __init__(self, partial: bool) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        if partial:
            self.context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        else:
            self.context_fn = lambda: create_selective_checkpoint_contexts(save_matmuls)
        self.context_fn.cache_hash = "save-matmuls-v1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn).sum()


def compile_once(partial: bool) -> None:
    from torch._dynamo.utils import counters

    torch.compile(Checkpointed(partial))(torch.randn(4, 16, requires_grad=True)).backward()
    print(json.dumps(dict(counters["aot_autograd"])))


def main() -> None:
    partial = "--partial" in sys.argv
    if "--child" in sys.argv:
        compile_once(partial)
        return
    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
        command = [sys.executable, os.path.abspath(__file__), "--child"] + (["--partial"] if partial else [])
        for launch in ("first", "second"):
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            print(f"{launch} process, context_fn {'a partial' if partial else 'a lambda'} with cache_hash: "
                  f"{done.stdout.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
