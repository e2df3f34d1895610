"""Capture the graphs of a step too large for this machine, to predict it on a hardware profile.

Build the model on the meta device inside a fake process group of the job's world size, shard it
as the job does, and capture one compiled step: the forward and backward graphs come out as
fsdp_graph's scheduling passes receive them, with full-size shapes and no memory or communication
spent (`examples/benchmark_compile.py --predict-8b` and `examples/benchmark_tp.py --predict-70b`
replay them on `h100-nvlink`).

    with fsdp_graph.predict.fake_world(64):
        with torch.device("meta"):
            model = Llama(cfg)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        graphs = fsdp_graph.predict.capture_graphs(model, tokens_on_meta)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.fx import GraphModule

from .backend import BackendConfig
from .partition import partition
from ..passes.pipeline import PassPipeline
from ..runtime.state import capturing_graphs


@contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """This process as rank 0 of a fake process group of `world_size` ranks: collectives return
    tensors of the right shapes and move no data. The group is destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise ValueError("fake_world() needs a process without a default process group; call "
                         "torch.distributed.destroy_process_group() first, or predict in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def capture_graphs(
    model: torch.nn.Module,
    *args: Any,
    memory_budget_bytes: Optional[int] = None,
    loss: Callable[[Any], torch.Tensor] = lambda output: output.sum(),
) -> dict[str, GraphModule]:
    """Compile `model(*args)` and `loss(output).backward()` once; returns {"forward": ...,
    "backward": ...}: the graphs after the backend's joint passes (selective unsharding under
    `memory_budget_bytes`, then resharding after forward) and its partitioner, before scheduling.
    Nothing is computed: the graphs are only captured, so the inputs may be on the meta device."""
    joint = PassPipeline("joint", BackendConfig(memory_budget_bytes=memory_budget_bytes).joint_passes(), frozenset(), None)
    graphs: dict[str, GraphModule] = {}

    def partition_joint(joint_gm, joint_inputs, **kwargs):
        return partition(joint(joint_gm, "graph"), joint_inputs, **kwargs)

    def keep(kind: str):
        def compile_graph(gm: GraphModule, _inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition_joint,
                           keep_inference_input_mutations=True)
    torch._dynamo.reset()
    with capturing_graphs(model):
        loss(torch.compile(model, backend=backend, fullgraph=True)(*args)).backward()
    torch._dynamo.reset()
    return graphs
