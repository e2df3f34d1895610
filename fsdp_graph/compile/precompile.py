"""Compile a sharded model's step once, save it, and load it on relaunch without tracing again.

    compiled = fsdp_graph.precompile(model, (tokens,), save_dir="compiled")
    loss = loss_fn(compiled(tokens), labels)
    loss.backward()

`torch.compile` re-traces the model with Dynamo in every new process, even when Inductor's and
AOTAutograd's caches hit; with fsdp_graph's hooks traced into the graph that is most of a warm
restart. `precompile` traces the whole forward once (`fullgraph=True`) with torch's ahead-of-time
compile, saves the result (Dynamo's bytecode and guards, the compiled forward and backward) in one
file per rank, and on the next launch loads it instead: no tracing, no compiling.

What keeps a saved step honest:
- A file is used only if it was made by the same torch, Python and fsdp_graph sources (our passes
  scheduled it, untraced by Dynamo), with the same backend config, the same meshes (ranks and
  process-group names, since the graph names its groups), and unchanged source code in every
  function it traced (Dynamo's checksums). Otherwise it is compiled again and
  overwritten, with a log line saying why.
- Every call checks the saved guards (parameter and input shapes, dtypes, `training`, and the
  state the hooks read). A call they reject, e.g. another batch shape or `model.eval()`, runs
  through a plain `torch.compile(model, backend=...)` instead: the same numbers, compiled as
  torch.compile would.
- A model that does not trace as one graph (a graph break) cannot be saved; `precompile` warns
  and returns the plain `torch.compile(model, backend=...)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import logging
import os
import sys
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .backend import BACKEND_NAME, BackendConfig
from .cache_key import own_sources_digest
from ..api.module import _fsdp_states as _states
from ..traced.scope import capture_for

logger = logging.getLogger(__name__)

FORMAT = 1  # of the header next to each saved step


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # What is traced and saved: one call of the module, hooks included. A module-level function,
    # so that the saved step refers to it by name.
    return module(*args, **kwargs)


class PrecompiledModel:
    """A model's saved compiled step, callable as the model; see the module docstring."""

    def __init__(self, model: nn.Module, compiled: Any, backend: Any, source: str) -> None:
        self.model = model
        self.source = source  # "loaded" or "compiled"
        self._compiled = compiled
        self._backend = backend
        self._fallback: Optional[Callable] = None
        compiled.disable_guard_check()  # checked here first, to fall back instead of raising

    def __getattr__(self, name: str) -> Any:
        # `parameters()`, `state_dict()`, ...: the model's own, with its own names.
        if name.startswith("_") or name == "model":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled.guard_check(self.model, *args, **kwargs):
            return self._compiled(self.model, *args, **kwargs)
        if self._fallback is None:
            logger.info("fsdp_graph.precompile: a call the saved step's guards reject; compiling it with torch.compile")
            self._fallback = torch.compile(self.model, backend=self._backend)
        return self._fallback(*args, **kwargs)


def precompile(
    model: nn.Module,
    example_args: tuple = (),
    example_kwargs: Optional[dict] = None,
    *,
    save_dir: str | os.PathLike,
    backend: Any = BACKEND_NAME,
) -> Callable:
    """Load this rank's saved compiled step of `model` from `save_dir`, or compile and save it.

    Call after `fully_shard` (and before the first step), on every rank, with inputs shaped as the
    training steps' (a batch of them). Returns a callable used in place of `model`: it runs the
    compiled forward, and `backward()` on its result runs the compiled backward, as with
    `torch.compile(model, backend=backend)`.
    """
    states = _states(model, "fsdp_graph.precompile")  # TypeError, or ValueError before fully_shard
    if not isinstance(example_args, tuple):
        raise TypeError(
            f"example_args must be a tuple of the model's positional inputs, got {type(example_args).__name__}; "
            f"e.g. precompile(model, (tokens,), save_dir=...)"
        )
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict or None, got {type(example_kwargs).__name__}")
    if not isinstance(save_dir, (str, os.PathLike)):
        raise TypeError(f"save_dir must be a directory path, got {type(save_dir).__name__}; e.g. save_dir='compiled'")
    kwargs = example_kwargs or {}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, f"step.rank{rank}-of-{world}")
    header = _header(model, states, backend)
    compiled = _load(path, header, model, example_args, kwargs)
    if compiled is not None:
        return PrecompiledModel(model, compiled, backend, "loaded")
    try:
        with _guard_config(), capture_for(backend):
            compiled = torch.compile(_call, backend=backend, fullgraph=True)
            compiled = compiled.aot_compile(((model, *example_args), kwargs))
        compiled.save_compiled_function(path + ".bin")
    except Exception as error:  # a graph break, or something torch cannot save
        warnings.warn(
            f"fsdp_graph.precompile could not save a compiled step ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300]}); using torch.compile(model, backend=...) instead, "
            f"which traces again on every launch",
            stacklevel=2,
        )
        return torch.compile(model, backend=backend)
    with open(path + ".json", "w") as f:
        json.dump(header, f, indent=1)
    return PrecompiledModel(model, compiled, backend, "compiled")


def _guard_config():
    """Dynamo's config while a step's guards are built, at compile and again at every load.

    [Note: Aliasing guards of a saved step]
    The step reaches the same objects by several paths (every parameter's DTensor holds the one
    mesh; a module is both its parent's child and a parameter's owner), so Dynamo guards that they
    are still the same objects: about 200 "a is b" guards for the example Llama. By default Dynamo
    checks them in one Python lambda whose source it first simplifies (common subexpressions of
    long attribute chains, parsed and printed with `ast`), a large part of rebuilding the guards at
    every relaunch. `use_lamba_guard_for_object_aliasing=False` installs the same checks as Dynamo's
    C++ relational guards instead: the same conditions, built without that work.
    """
    return torch._dynamo.config.patch(use_lamba_guard_for_object_aliasing=False)


def _header(model: nn.Module, states: list, backend: Any) -> dict:
    """What a saved step depends on beyond its guards and traced sources."""
    meshes = {_describe_mesh(state.group.mesh_info.mesh) for state in states if state.group is not None}
    for param in model.parameters():
        if isinstance(param, DTensor):
            meshes.add(_describe_mesh(param.device_mesh))
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "backend": _describe_backend(backend),
        "fsdp_graph": own_sources_digest(),
        "meshes": sorted(meshes),
    }


def _describe_backend(backend: Any) -> str:
    config = getattr(backend, "config", None)
    if not isinstance(config, BackendConfig):
        return repr(backend)
    # Sets print in hash order, which changes between processes.
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return repr({name: sorted(v) if isinstance(v, frozenset) else v for name, v in fields.items()})


def _describe_mesh(mesh) -> str:
    names = [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]
    return f"{mesh.device_type} {mesh.mesh.tolist()} dims={mesh.mesh_dim_names} groups={names}"


def _load(path: str, header: dict, model: nn.Module, args: tuple, kwargs: dict) -> Optional[Any]:
    """The saved step at `path` if it still fits, else None (with the reason logged)."""
    if not os.path.exists(path + ".bin") or not os.path.exists(path + ".json"):
        return None
    with open(path + ".json") as f:
        saved = json.load(f)
    changed = [key for key in header if saved.get(key) != header[key]]
    if changed:
        logger.warning("fsdp_graph.precompile: recompiling %s: %s changed", path, ", ".join(changed))
        return None
    try:
        with open(path + ".bin", "rb") as f, _guard_config():
            compiled = torch.compiler.load_compiled_function(f)
    except Exception as error:
        logger.warning("fsdp_graph.precompile: recompiling %s: it does not load (%s: %s)", path, type(error).__name__, error)
        return None
    changed_source = _changed_source(compiled)
    if changed_source is not None:
        logger.warning("fsdp_graph.precompile: recompiling %s: %s changed", path, changed_source)
        return None
    if not compiled.guard_check(model, *args, **kwargs):
        logger.warning("fsdp_graph.precompile: recompiling %s: its guards reject these inputs", path)
        return None
    return compiled


def _changed_source(compiled: Any) -> Optional[str]:
    """Where the code a saved step traced differs from the code imported now, or None."""
    for source in compiled.source_info().inlined_sources:
        try:
            module = importlib.import_module(source.module)
            lines = inspect.getsourcelines(module)[0][source.firstlineno - 1 : source.lastlineno - 1]
        except (ImportError, OSError, TypeError):
            return f"{source.module} (cannot read its source)"
        if hashlib.sha256("".join(lines).encode()).hexdigest() != source.checksum:
            return f"{source.module} lines {source.firstlineno}-{source.lastlineno}"
    return None
