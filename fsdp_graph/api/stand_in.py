"""`use_in_place_of_torch_fsdp()`: frameworks that call torch's `fully_shard` get fsdp_graph's.

torchtitan, Hugging Face Accelerate, Lightning and TRL call `fully_shard` for the user, with
`from torch.distributed.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy` at import time or
inside their functions. This puts fsdp_graph's objects under those names, so such code shards,
checks `isinstance(module, FSDPModule)` and builds policies with ours, and takes them back on
`restore()` (or at the end of a `with` block).

[Note: Where the names are replaced]
1. In torch's public namespaces for FSDP2 (`torch.distributed.fsdp`, its `_fully_shard` package, and
   the older `torch.distributed._composable.fsdp`): what every later `from ... import` finds, and
   what imports inside functions find at call time.
2. In every module already loaded, outside torch and fsdp_graph, whose globals hold one of torch's
   objects under any name (`from torch.distributed.fsdp import fully_shard as shard`): a framework
   imported before this call gets ours too.
torch's own modules keep their references (torch's FSDP2 stays whole, for code that compares with
it), and so do a framework's closures and default arguments, which this cannot reach: call this
before the framework builds its model. Nothing here runs torch's FSDP2; the namespace is imported
only to hold our names.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Optional

from ..runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .mesh import DataParallelMeshDims
from .module import FSDPModule, UnshardHandle
from .sharding import fully_shard, register_fsdp_forward_method, share_comm_ctx

logger = logging.getLogger(__name__)

# The names torch's FSDP2 exports, each with ours.
_OURS = {
    "fully_shard": fully_shard,
    "FSDPModule": FSDPModule,
    "UnshardHandle": UnshardHandle,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "share_comm_ctx": share_comm_ctx,
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
    "DataParallelMeshDims": DataParallelMeshDims,
}
_TORCH_NAMESPACES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
)
_NOT_SCANNED = ("torch", "fsdp_graph")  # packages whose references stay: [Note: Where the names are replaced]


class TorchFSDPReplaced:
    """What `use_in_place_of_torch_fsdp` replaced; `restore()` puts torch's objects back.

    Also a context manager: `with fsdp_graph.use_in_place_of_torch_fsdp(): ...` restores on exit.
    """

    def __init__(self) -> None:
        # (module, attribute, torch's object, ours), in the order they were replaced.
        self._replaced: list[tuple[types.ModuleType, str, object, object]] = []
        self.active = False

    def _apply(self) -> None:
        originals: dict[int, str] = {}  # id(torch's object) -> its name
        for namespace in _TORCH_NAMESPACES:
            module = importlib.import_module(namespace)
            for name, ours in _OURS.items():
                theirs = module.__dict__.get(name)
                if theirs is None or theirs is ours:
                    continue
                originals[id(theirs)] = name
                self._replace(module, name, ours)
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType) or module.__name__.split(".")[0] in _NOT_SCANNED:
                continue
            for attribute, value in list(vars(module).items()):
                name = originals.get(id(value))
                if name is not None:
                    self._replace(module, attribute, _OURS[name])
        self.active = True
        logger.info("fsdp_graph: %d references to torch's FSDP2 now name fsdp_graph's", len(self._replaced))

    def _replace(self, module: types.ModuleType, attribute: str, ours: object) -> None:
        self._replaced.append((module, attribute, module.__dict__[attribute], ours))
        setattr(module, attribute, ours)

    def restore(self) -> None:
        """Put back every reference this replaced (those still holding ours). Idempotent."""
        global _active
        for module, attribute, theirs, ours in reversed(self._replaced):
            if module.__dict__.get(attribute) is ours:  # not what someone set since
                setattr(module, attribute, theirs)
        self._replaced.clear()
        self.active = False
        if _active is self:
            _active = None

    def __enter__(self) -> "TorchFSDPReplaced":
        return self

    def __exit__(self, *_exc) -> None:
        self.restore()


_active: Optional[TorchFSDPReplaced] = None  # the one replacement in force, if any


def use_in_place_of_torch_fsdp() -> TorchFSDPReplaced:
    """Make code that uses torch's `fully_shard` (and `FSDPModule`, the policies,
    `DataParallelMeshDims`) use fsdp_graph's; returns the handle whose `restore()` undoes it.

    Call it before the framework shards the model (torchtitan's `Trainer`, Accelerate's `prepare`,
    Lightning's `configure_model`); see docs/frameworks/README.md. Calling it again while it is in force
    returns the same handle.
    """
    global _active
    if _active is None or not _active.active:
        _active = TorchFSDPReplaced()
        _active._apply()
    return _active
