"""Warm restarts load compiled graphs from the caches: the FX graph cache and AOTAutogradCache.

Fresh processes share one Inductor cache directory, on a fake 2-rank process group: rank 0
compiles (and saves). Rank 1 in a new process is both a restart and another rank (the DeviceMesh
inputs differ in `_rank`, `_coordinate_on_dim`, thread id and hash salt, see
fsdp_graph/compile/cache_key.py): with shards of the same shapes it must load both graphs from the caches;
with shards one row shorter (uneven dim 0) too: the step's graph reads each group's row, padded to
one width on every rank, and each rank's valid rows are taken outside it ([Note: Compiled gradients
arrive as the row's] in runtime/shard_buffer.py).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from _harness import run_process

pytestmark = pytest.mark.slow  # Inductor compiles in fresh processes

_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.utils import counters
import fsdp_graph
from _models import MLPStack
from fsdp_graph import fully_shard

dist.init_process_group("fake", store=FakeStore(), rank={rank}, world_size=2)
torch.manual_seed(0)
model = MLPStack(num_blocks=1) if {uneven} else torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
blocks = model.blocks if {uneven} else model[:1]
for block in blocks:
    fully_shard(block)
fully_shard(model)
torch.compile(model, backend=fsdp_graph.backend(pieces={pieces}))(torch.randn(4, 13 if {uneven} else 16)).sum().backward()
print(json.dumps({{**counters["inductor"], **counters["aot_autograd"]}}))
"""


def _compile_in_fresh_process(rank: int, cache_dir: Path, uneven: bool, pieces: bool = True, **env_vars: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), **env_vars}
    script = _SCRIPT.format(tests=str(Path(__file__).resolve().parent), rank=rank, uneven=uneven, pieces=pieces)
    done = run_process([sys.executable, "-c", script], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "one_graph"])
def test_restart_on_another_rank_hits_both_caches_and_the_fx_graph_cache_alone(tmp_path, pieces):
    """Rank 0 compiles; rank 1, restarted, loads the step from both caches, and restarted again
    without AOTAutogradCache finds each graph in Inductor's FX graph cache: where AOTAutogradCache
    cannot serve the step (it refuses selective activation checkpointing whose context_fn has no
    cache_hash, as torchtitan's). The backward is lowered lazily, at the first backward, after our
    backend returned: its key held the mesh's per-process fields, so every restart compiled the
    backward again. In pieces (the default), AOTAutogradCache holds the whole program and the FX
    graph cache each piece ([Note: A step of pieces in AOTAutograd's cache])."""
    first = _compile_in_fresh_process(0, tmp_path, uneven=False, pieces=pieces)
    compiled = first.get("fxgraph_cache_miss", 0)  # forward and backward, or each distinct piece of them
    assert (compiled >= 2 if pieces else compiled == 2) and first.get("autograd_cache_saved") == 1, first
    second = _compile_in_fresh_process(1, tmp_path, uneven=False, pieces=pieces)
    # The whole compiled pair from AOTAutogradCache (which names the one graph's forward and backward
    # in the FX graph cache, and holds a program of pieces itself), nothing compiled.
    assert second.get("autograd_cache_hit") == 1 and "autograd_cache_bypass" not in second, second
    assert "fxgraph_cache_miss" not in second and second.get("fxgraph_cache_hit", 0) == (0 if pieces else 2), second
    third = _compile_in_fresh_process(1, tmp_path, uneven=False, pieces=pieces, TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    assert third.get("fxgraph_cache_hit") == compiled and "fxgraph_cache_miss" not in third, third


def test_ranks_with_shorter_shards_load_the_same_step(tmp_path):
    first = _compile_in_fresh_process(0, tmp_path, uneven=True)
    assert first.get("autograd_cache_saved") == 1, first
    other_rank = _compile_in_fresh_process(1, tmp_path, uneven=True)  # its shards are a row shorter
    assert other_rank.get("autograd_cache_hit") == 1 and "fxgraph_cache_miss" not in other_rank, other_rank


_CHECKPOINTED = """
import json, sys, torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
import fsdp_graph
from fsdp_graph import fully_shard


class Checkpointed(torch.nn.Module):
    def __init__(self, cache_hash):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 4)

        def policy(ctx, func, *args, **kwargs):  # a local function, as torchtitan's
            return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        self.context_fn = lambda: create_selective_checkpoint_contexts(policy)
        if cache_hash is not None:
            self.context_fn.cache_hash = cache_hash

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=False, context_fn=self.context_fn))


dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
torch.manual_seed(0)
model = Checkpointed({cache_hash!r})
fully_shard(model.block)
fully_shard(model)
torch.compile(model, backend=fsdp_graph.backend())(torch.randn(4, 16)).sum().backward()
print(json.dumps(dict(counters["aot_autograd"])))
"""


def test_a_checkpoint_policy_with_a_cache_hash_is_served_by_aotautogradcache(tmp_path):
    """Selective checkpointing whose context_fn is a lambda over a local policy (as torchtitan's),
    given a `cache_hash` as torch asks: a restart loads the step from AOTAutogradCache, where torch
    alone pickles the lambda into the key and bypasses the cache (examples/repro/
    checkpoint_policy_cache_hash.py). Another hash misses; no hash bypasses, as in torch.
    [Note: A checkpoint policy's cache_hash] in fsdp_graph/compile/cache_key.py."""

    def compile_once(cache_hash):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
        done = run_process([sys.executable, "-c", _CHECKPOINTED.format(cache_hash=cache_hash)], env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = compile_once("policy-a")
    assert first.get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in first, first
    restart = compile_once("policy-a")
    assert restart.get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in restart, restart
    other = compile_once("policy-b")
    assert other.get("autograd_cache_miss") == 1 and "autograd_cache_hit" not in other, other
    unhashed = compile_once(None)
    assert unhashed.get("autograd_cache_bypass") == 1, unhashed


_ATTENTION = """
import json, torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.utils import counters
import fsdp_graph
from fsdp_graph import fully_shard


class Attention(torch.nn.Module):  # enters sdpa_kernel in forward, as torchtitan's attention
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.MATH):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
torch.manual_seed(0)
model = torch.nn.Sequential(Attention(), Attention())
for block in model:
    fully_shard(block)
fully_shard(model)
torch.compile(model, backend=fsdp_graph.backend(pieces={pieces}))(torch.randn(2, 8, 16)).sum().backward()
print(json.dumps(dict(counters["aot_autograd"])))
"""


@pytest.mark.parametrize("pieces", [True, False], ids=["pieces", "one_graph"])
def test_a_step_that_enters_sdpa_kernel_is_served_by_aotautogradcache(tmp_path, pieces):
    """A step whose blocks enter `sdpa_kernel` (torchtitan's attention does): a restart loads it from
    AOTAutogradCache, where torch alone bypasses the cache for such a graph and the relaunch traces,
    partitions and schedules the whole step again (examples/repro/sdpa_kernel_autograd_cache.py).
    [Note: sdpa_kernel in a cached graph] in fsdp_graph/compile/cache_key.py."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def compile_once():
        done = run_process([sys.executable, "-c", _ATTENTION.format(pieces=pieces)], env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = compile_once()
    assert first.get("autograd_cache_saved") == 1 and "autograd_cache_bypass" not in first, first
    restart = compile_once()
    assert restart.get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in restart, restart
