"""Stand-ins that let fsdp_graph's compiled steps run on torch 2.11, the only torch on the lent
device machine (2.13's CUDA build is too large to carry there). Imported by `run211.py`; not part
of the package, and never needed on the tested torch (each stand-in checks for what it replaces).

1. `torch.fx.experimental.symbolic_shapes.optimization_hint` (new in 2.13, the passes' size hints):
   a symbolic size's hint, else the fallback.
2. `torch.compiler.nested_compile_region(max_reuse_entries=...)`: 2.11 has no such argument; it is
   dropped.
3. The traced unshard's un-shadowing (traced/unshard.py, `install`): 2.11's Dynamo traces no way of
   removing a key from a module's `__dict__` (examples/repro/module_dict_delete_traced.py), so the
   shadow is pointed back at the registered (sharded) parameter, which the module's forward and
   users then read as before. A module that ran compiled keeps that entry: the eager hooks, which
   register the unsharded parameter in `_parameters`, would not be seen by its forward, so this
   stand-in is for compiled steps only.
4. 2.11 has no `torch._higher_order_ops.passes.inline_invoke_subgraph`, which a step with compile
   regions needs: every block is traced inline (`regions="marked"`; the example Llama marks none).
"""

import inspect
import sys
import types

import torch
import torch.fx.experimental.symbolic_shapes as symbolic_shapes

if not hasattr(symbolic_shapes, "optimization_hint"):

    def optimization_hint(a, fallback=None):
        if isinstance(a, torch.SymInt):
            hint = a.node.hint
            return fallback if hint is None else hint
        return a

    symbolic_shapes.optimization_hint = optimization_hint

_region = torch.compiler.nested_compile_region
if "max_reuse_entries" not in inspect.signature(_region).parameters:

    def nested_compile_region(fn=None, **kwargs):
        kwargs.pop("max_reuse_entries", None)
        return _region(fn, **kwargs) if fn is not None else _region(**kwargs)

    torch.compiler.nested_compile_region = nested_compile_region

_has_inline_pass = True
try:
    import torch._higher_order_ops.passes.inline_invoke_subgraph  # noqa: F401
except ImportError:
    _has_inline_pass = False

from fsdp_graph.traced.scope import REGIONS_ATTR  # noqa: E402  (after the stand-ins the import needs)
from fsdp_graph.compile.backend import fsdp_graph_backend  # noqa: E402
from fsdp_graph.traced import hooks as traced  # noqa: E402  (the traced hooks call `install` by this name)

_install = traced.install


def install(group, unsharded):
    if unsharded is not None:
        return _install(group, unsharded)
    for module, name, _ in group.owner_slots:
        module.__dict__[name] = module._parameters[name]


def _dynamo_deletes_dict_keys() -> bool:
    module = torch.nn.Linear(1, 1)

    def remove(x):
        module.__dict__["weight"] = x
        del module.__dict__["weight"]
        return x + 1

    try:
        torch.compile(remove, fullgraph=True, backend="eager")(torch.ones(1))
        return True
    except Exception:  # Dynamo's Unsupported, wrapped
        return False
    finally:
        torch._dynamo.reset()


if not _dynamo_deletes_dict_keys():
    traced.install = install

if not _has_inline_pass:
    setattr(fsdp_graph_backend, REGIONS_ATTR, "marked")

    def inline_invoke_subgraph(gm):
        raise NotImplementedError("torch 2.11: this run traces no compile regions")

    passes = types.ModuleType("torch._higher_order_ops.passes")
    inline = types.ModuleType("torch._higher_order_ops.passes.inline_invoke_subgraph")
    inline.inline_invoke_subgraph = inline_invoke_subgraph
    sys.modules.setdefault(passes.__name__, passes)
    sys.modules.setdefault(inline.__name__, inline)
