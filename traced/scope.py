"""Which compile scope a sharded module's call is traced for: the `scope` of the backend Dynamo
traces for (`fsdp_graph.backend(scope=...)`, fsdp_graph/compile/backend.py).

[Note: Compile scope]
Whether a sharded module's call is traced into the graph of its caller (scope "step") or runs its
hooks on the eager runtime around a body Dynamo compiles on its own (scope "block", FSDP2 +
torch.compile's structure) is decided while Dynamo traces the call, by `FSDPModule.__call__`. The
backend that will compile the graph is the one Dynamo's current translation was started for:
`traced_scope` reads it there, and Dynamo takes the answer as a constant of the trace (no guard is
needed: Dynamo keeps each backend's compiled code apart). The fsdp_graph backend says its scope
with a `SCOPE_ATTR` attribute (the registered one's default, or `options={"scope": ...}`), as does
fsdp_graph.predict's own capture ("step"). `aot_compile` (fsdp_graph.precompile) captures the graph
before it hands it to the backend, so Dynamo holds no backend while it traces: precompile names the
backend around it (`capture_for`). Any other backend ("inductor", "aot_eager",
`torch.compile(model)`) gets block scope, FSDP2's structure: it has no pass that reshards after
forward, so in a step traced for it the partitioner saved every gathered weight for backward: fewer
all-gathers than FSDP2 + compile, and every gathered weight alive until backward
(tests/test_compile_blocks.py counts the collectives; docs/compiler.md has the figures). A module run in block scope is not a fallback: every rank runs every
group on the eager hooks, so the groups prefetch and reshard as in eager mode.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal, get_args

import torch

Scope = Literal["step", "block"]  # what one compiled graph spans: `BackendConfig.scope`
SCOPES: tuple[str, ...] = get_args(Scope)
SCOPE_ATTR = "fsdp_graph_scope"  # on a backend: the scope it compiles for
Regions = Literal["marked", "blocks"]  # which blocks a step traces as compile regions: `BackendConfig.regions`
REGIONS: tuple[str, ...] = get_args(Regions)
REGIONS_ATTR = "fsdp_graph_regions"  # on a backend: its `regions`
_captures: list[dict[str, str]] = []  # innermost last: the settings of `capture_for`'s backends


def _traced_backend_setting(attr: str, option: str, default: str) -> str:
    """The setting `attr` of the backend Dynamo is tracing for (or `option` in the options it was
    given); `default` for a backend without it."""
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    fn = getattr(getattr(tx, "output", None), "compiler_fn", None)
    options: dict = {}
    while fn is not None:  # Dynamo wraps the backend (WrapBackendDebug, the options' wrapper)
        kwargs = getattr(fn, "kwargs", None)
        if isinstance(kwargs, dict) and isinstance(kwargs.get("options"), dict):
            options = kwargs["options"]
        value = getattr(fn, attr, None)
        if value is not None:
            return options.get(option, value)
        fn = getattr(fn, "compiler_fn", None)
    return default


@torch._dynamo.assume_constant_result
def traced_scope() -> str:
    """The scope of the backend Dynamo is tracing for: its `SCOPE_ATTR` (or the scope in the options
    it was given); "block" for a backend without one."""
    if _captures:
        return _captures[-1][SCOPE_ATTR]
    return _traced_backend_setting(SCOPE_ATTR, "scope", "block")


@torch._dynamo.assume_constant_result
def traced_regions() -> str:
    """Which blocks the step Dynamo is tracing takes as compile regions: the backend's `regions`
    ([Note: Every block a compile region] in traced/regions.py); "marked" for a backend
    without one."""
    if _captures:
        return _captures[-1][REGIONS_ATTR]
    return _traced_backend_setting(REGIONS_ATTR, "regions", "marked")


@contextlib.contextmanager
def capture_for(backend: Any) -> Iterator[None]:
    """Trace for `backend` (a backend or a registered backend's name: its scope and regions) where
    Dynamo does not hold the backend while it traces (`aot_compile` captures the graph first and
    hands it to the backend after)."""
    found = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    _captures.append({SCOPE_ATTR: getattr(found, SCOPE_ATTR, "block"), REGIONS_ATTR: getattr(found, REGIONS_ATTR, "marked")})
    try:
        yield
    finally:
        _captures.pop()
