"""fsdp_graph: fully sharded data parallel training as FX graph passes over an eager runtime.

    from fsdp_graph import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model = torch.compile(model, backend="fsdp_graph")   # optional: collectives inside the graph
    model = fsdp_graph.precompile(model, (batch,), save_dir="compiled")   # or: compiled once, loaded on relaunch

One subpackage per kind of reader; the names above are re-exported here:

    api/       `fully_shard`, `FSDPModule` and their checks; `PipelineStage` (api/pipelining.py);
               `run_in_chunks` (a MoE layer on slices of its tokens)
    compile/   the `fsdp_graph` torch.compile backend, `precompile`, cache keys, the partitioner
    inspect/   graph dumps, `python -m fsdp_graph.inspect DIR`, the predicted timeline, Chrome traces
    fsdp1/     FSDP1's conveniences above `fully_shard`: `wrap`, `full_params`, `comm_hooks`
    optim/     `fsdp_graph.optim.Muon` and `WholeMatrixOptimizer`: matrix optimizers on sharded parameters
    predict.py a step's graphs captured at any world size and predicted on a hardware profile
               (`fsdp_graph.predict.fake_world`, `capture_graphs`, `schedule_graphs`, `predict_step`)
"""

from .api import (
    DataParallelMeshDims, FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, run_in_chunks, share_comm_ctx,
)
from .api.stand_in import TorchFSDPReplaced, use_in_place_of_torch_fsdp
from .compile.backend import BackendConfig, Compiler, backend
from .compile.precompile import precompile
from .runtime.custom_comms import AllGather, ReduceScatter
from .runtime.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "AllGather",
    "BackendConfig",
    "Compiler",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReduceScatter",
    "TorchFSDPReplaced",
    "UnshardHandle",
    "backend",
    "fully_shard",
    "precompile",
    "register_fsdp_forward_method",
    "run_in_chunks",
    "share_comm_ctx",
    "use_in_place_of_torch_fsdp",
]
