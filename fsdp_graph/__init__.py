"""fsdp_graph: fully sharded data parallel training as FX graph passes over an eager runtime.

    from fsdp_graph import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model = torch.compile(model, backend="fsdp_graph")   # optional: collectives inside the graph
    model = fsdp_graph.precompile(model, (batch,), save_dir="compiled")   # or: compiled once, loaded on relaunch
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from .backend import BackendConfig, Compiler, backend
from .precompile import precompile
from .runtime.comms import AllGather, ReduceScatter
from .runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "AllGather",
    "BackendConfig",
    "Compiler",
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "UnshardHandle",
    "backend",
    "fully_shard",
    "precompile",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
