"""fsdp_graph: fully sharded data parallel training as FX graph passes over an eager runtime.

    from fsdp_graph import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
"""

from .api import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
]
