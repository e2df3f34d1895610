"""Compile-cache keys that are the same on every rank and in every process (torch>=2.13,<2.14).

[Note: Rank-independent cache keys]
Dynamo hands our backend the sharded DTensor parameters as graph inputs, and AOTAutograd desugars
each into its local tensor and its DeviceMesh, an opaque graph input. Inductor's FX graph cache and
AOTAutogradCache hash their inputs by pickling them, and a DeviceMesh pickles its whole `__dict__`:
this rank (`_rank`, `_coordinate_on_dim`), the creating thread's id and a lazily cached `hash()`
of strings, which Python salts per process. So every rank and every restart computed a different
key for the same graph and compiled it again: a relaunch compiled its first step instead of
loading it. And AOTAutogradCache refused our graphs outright, since the traced
all-gather is a custom autograd.Function (`traced/ops.py: AllGatherShards`).

While our backend compiles (`stable_cache_keys()`), a DeviceMesh pickles without those fields, and
AOTAutogradCache accepts custom autograd.Functions. Both are sound for our graphs: the mesh's
layout, device and process group names (which the graph's collectives name) stay in the key, and the
autograd.Function's forward and backward are traced subgraphs of the Dynamo graph, which is itself
hashed. A plain group's gather is one op in Dynamo's graph (`fsdp_graph::gather_group`), whose
kernel calls the Functions: its source is ours, so `own_sources_digest` is in the key. The pickled
mesh still unpickles into a working mesh (the dropped fields are recomputed for the loading
process), in case the cache stores one rather than only hashing it.

What differs between ranks and matters is the shape of each shard: AOTAutogradCache keys a DTensor
input by its global shape, but with an uneven dim 0 rank 1's shard is a row shorter than rank 0's,
and the compiled code checks the local shapes. So our passes' `uuid`s (part of both keys, as
Inductor config) carry `local_shapes(example_inputs)`: ranks with equal shards share graphs, the
others compile their own, and every restart loads its own. Where the groups run on gloo, every
rank compiles its own graphs too: a backward there reads this rank's row of each reduce-scatter
([Note: Reduce-scatters on gloo] in passes/gloo.py), so the schedule pass's key carries the rank
(`_gloo_rank` in fsdp_graph/compile/backend.py); without it a relaunch where one rank loaded the
backward the other compiled trained on the other rank's gradients.
The context patches `copyreg` for DeviceMesh, which the caches' picklers copy when they are made.
Outside the context nothing changes. Every Inductor compile of ours runs in it, the backward's too,
which AOTAutograd lowers lazily at the first backward, after the backend returned (`_inner_compile`
in fsdp_graph/compile/backend.py): outside it, a backward's key held the mesh's per-process fields,
and every launch that could not load the step from AOTAutogradCache (torchtitan's selective
activation checkpointing, whose context_fn has no cache_hash) compiled the backward again.
"""

from __future__ import annotations

import copyreg
import functools
import hashlib
import importlib
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
import torch._inductor.config
from torch._inductor.custom_graph_pass import CustomGraphPass

# What a DeviceMesh holds that differs between ranks or processes of the same job (and the process
# groups, which do not pickle).
_PER_PROCESS = ("_rank", "_coordinate_on_dim", "_thread_id", "_hash", "_pg_registry")


def _reduce_mesh(mesh: DeviceMesh) -> tuple:
    state = {name: value for name, value in mesh.__dict__.items() if name not in _PER_PROCESS}
    return _rebuild_mesh, (state,)


def _rebuild_mesh(state: dict[str, Any]) -> DeviceMesh:
    mesh = DeviceMesh.__new__(DeviceMesh)
    mesh.__setstate__(state)  # resolves the process groups by name
    mesh._rank = dist.get_rank()
    mesh._thread_id = threading.get_ident()
    mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()
    return mesh


def local_shapes(example_inputs) -> str:
    """The local shard shapes of a graph's DTensor inputs, for our passes' cache `uuid`s: the caches
    key a DTensor by its global shape, and the shard's shape is what the compiled code checks."""
    return ";".join(
        "x".join(map(str, t._local_tensor.shape)) for t in example_inputs if isinstance(t, DTensor)
    )


class KeyOnly(CustomGraphPass):
    """A pass that changes nothing, for its `uuid`: puts `key` into the FX graph cache's and
    AOTAutogradCache's keys for work that happens outside Inductor's passes: our passes on a graph
    compiled in pieces (this rank on gloo, the wire order, the options), and how a piece is compiled
    (fsdp_graph/compile/pieces.py)."""

    def __init__(self, key: Optional[str]) -> None:
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> Optional[str]:
        return self.key


@functools.lru_cache(maxsize=None)
def own_sources_digest() -> str:
    """sha256 of fsdp_graph's own Python sources. Our passes shape every compiled graph but are not
    among the sources Dynamo traces, so the caches' keys for our graphs (the passes' `uuid`s) and a
    saved step's header (fsdp_graph/compile/precompile.py) carry this: a change to the passes or the runtime
    (e.g. a new scheduling rule) never loads a graph compiled before it."""
    digest = hashlib.sha256()
    for package in ("fsdp_graph", "fsdp_graph.runtime", "fsdp_graph.passes"):
        folder = os.path.dirname(importlib.import_module(package).__file__)
        for path in _python_files(folder):
            with open(os.path.join(folder, path), "rb") as f:
                digest.update(path.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _python_files(folder: str) -> list[str]:
    """The `.py` files under `folder`, subpackages included, as sorted relative paths."""
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found.extend(os.path.relpath(os.path.join(parent, f), folder) for f in files if f.endswith(".py"))
    return sorted(found)


# [Note: sdpa_kernel in a cached graph]
# Dynamo bakes `torch.nn.attention.sdpa_kernel` into the graph as calls of two private helpers of
# torch.nn.attention (`SDPAKernelVariable`), and AOTAutogradCache bypasses a graph holding a function
# it does not know: torchtitan's attention enters the context in every block, so a relaunch of its
# whole step traced and partitioned the graph and ran our passes again (torch alone:
# examples/repro/sdpa_kernel_autograd_cache.py). Both helpers are pure functions of constants the
# graph's code holds (a backend's name; the backends and a priority flag), and that code is in the
# key: while our backend compiles, they are marked cacheable through Inductor's own setting for
# this, keyed by torch's version.
_SDPA_KERNEL_HELPERS = {f"torch.nn.attention.{name}": torch.__version__ for name in ("_backend_from_string", "_sdpa_kernel")}


@contextmanager
def stable_cache_keys() -> Iterator[None]:
    """Within: compile-cache keys of graphs over DTensors are the same on every rank and restart
    (for the shards' shapes, see `local_shapes`), and graphs that enter `sdpa_kernel` are cached
    ([Note: sdpa_kernel in a cached graph])."""
    previous = copyreg.dispatch_table.get(DeviceMesh)
    copyreg.pickle(DeviceMesh, _reduce_mesh)
    try:
        marked = {**torch._inductor.config.unsafe_marked_cacheable_functions, **_SDPA_KERNEL_HELPERS}
        with torch._functorch.config.patch(autograd_cache_allow_custom_autograd_functions=True), \
                torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked):
            yield
    finally:
        if previous is None:
            del copyreg.dispatch_table[DeviceMesh]
        else:
            copyreg.dispatch_table[DeviceMesh] = previous


# [Note: A checkpoint policy's cache_hash]
# torch asks a user whose graph holds selective activation checkpointing to give the checkpoint's
# `context_fn` a `cache_hash` attribute ("a string ... that uniquely identifies the checkpointing
# behavior"), and AOTAutogradCache bypasses the graph without one. With one it still pickles the
# context_fn itself into the key (it sits in the checkpointed subgraph's `meta`), which fails for a
# lambda or a local function, torchtitan's among them, and bypasses again ("Can't pickle local
# object"; torch alone: examples/repro/checkpoint_policy_cache_hash.py). In the graphs our backend
# compiles, such a context_fn is replaced by `_HashedPolicy`, which calls it and pickles as its
# hash: the key holds what the user said identifies the policy, as torch's rule intends.


class _HashedPolicy:
    """A checkpoint `context_fn` with a `cache_hash`, that pickles as that hash."""

    def __init__(self, context_fn: Any) -> None:
        self.context_fn = context_fn
        self.cache_hash = context_fn.cache_hash

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.context_fn(*args, **kwargs)

    def __reduce__(self) -> tuple:
        return str, (f"checkpoint context_fn, cache_hash {self.cache_hash!r}",)


def hash_checkpoint_policies(gm: torch.fx.GraphModule) -> None:
    """Let AOTAutogradCache key `gm`'s selective checkpoints by their `context_fn`'s `cache_hash`
    where the user gave one. See [Note: A checkpoint policy's cache_hash]."""
    for module in gm.modules():
        context_fn = getattr(module, "meta", {}).get("_checkpoint_context_fn")
        if hasattr(context_fn, "cache_hash") and not isinstance(context_fn, _HashedPolicy):
            module.meta["_checkpoint_context_fn"] = _HashedPolicy(context_fn)


def beside_caches_file(kind: str, gm, example_inputs, options: str, groups: list[str]) -> str:
    """Where a note of `kind` about the graph `gm` is kept beside Inductor's caches: a file named by
    what the compiled graphs depend on, the same in every launch and on every rank that compiles
    the same graph: our sources, the backend's options, the Dynamo graph's code and its inputs'
    shapes, strides and dtypes (local shards included), and the groups' names."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    digest = hashlib.sha256()
    for part in (own_sources_digest(), options, gm.code, local_shapes(example_inputs), repr(groups)):
        digest.update(part.encode())
    for t in example_inputs:
        digest.update(repr((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t).encode())
    return os.path.join(cache_dir(), "fsdp_graph", kind, digest.hexdigest()[:32] + ".json")


def wire_orders_file(gm, example_inputs, options: str, groups: list[str]) -> str:
    """Where the wire orders of a frame's first graph `gm` are kept ([Note: Wire orders beside the
    compile caches] in fsdp_graph/compile/agreement.py)."""
    return beside_caches_file("wire_orders", gm, example_inputs, options, groups)

