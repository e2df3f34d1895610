"""The API a user calls: `fully_shard` and `FSDPModule`, with FSDP2's signatures and behaviour.

    sharding.py          `fully_shard`, `register_fsdp_forward_method`, `share_comm_ctx`
    module.py            `FSDPModule` (FSDP2's methods, with the checks of their arguments), `UnshardHandle`,
                         the `FSDP<Cls>` classes
    checks.py            what `fully_shard` checks before it shards anything
    mesh.py              the mesh it shards over (given, or one default mesh), `DataParallelMeshDims`
    optimizer_check.py   the optimizer step pre-hook (optimizers built before `fully_shard`, stale gathers)
    pipelining.py        `PipelineStage` for torch's pipeline schedules
    chunks.py            `run_in_chunks`: a module run on slices of its tokens (a MoE layer's all-to-alls in pairs)
    scope.py             whether a compiled call traces its hooks or runs them eagerly (the backend's `scope`)
"""

from .chunks import run_in_chunks
from .mesh import DataParallelMeshDims
from .module import FSDPModule, UnshardHandle
from .sharding import fully_shard, register_fsdp_forward_method, share_comm_ctx

__all__ = [
    "DataParallelMeshDims",
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "run_in_chunks",
    "share_comm_ctx",
]
