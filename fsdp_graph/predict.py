"""`fsdp_graph.predict`: capture the graphs of a step too large for this machine, to predict it on
a hardware profile.

Build the model on the meta device inside a fake process group of the job's world size, shard it
as the job does, and capture one compiled step: the forward and backward graphs come out as
fsdp_graph's scheduling passes receive them, with full-size shapes and no memory or communication
spent (`examples/benchmark_compile.py --predict-8b` and `examples/benchmark_tp.py --predict-70b`
replay them on `h100-nvlink`). `schedule_graphs` runs the backend's scheduling passes on them, with
the backend's options, and `predict_step` simulates the scheduled graphs as one step: time, exposed
communication per parallelism, and the peak memory of a rank.

    with fsdp_graph.predict.fake_world(64):
        with torch.device("meta"):
            model = Llama(cfg)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        graphs = fsdp_graph.predict.capture_graphs(model, tokens_on_meta)
        scheduled = fsdp_graph.predict.schedule_graphs(graphs, hardware_profile="h100-nvlink")
"""

from __future__ import annotations

import copy
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.fx import GraphModule

from .traced.scope import SCOPE_ATTR
from .compile.backend import BackendConfig, Compiler
from .compile.partition import partition
from .passes.checkpoint_policy import checkpoint_to_fit
from .passes.cost_model import CostModel
from .passes.pipeline import PassPipeline
from .passes.simulator import Simulation, program_of, simulate
from .passes.stamp import stamp_blocks
from .passes.table import Stage
from .runtime.state import FSDPState
from .traced.state import capturing_graphs

__all__ = ["StepPrediction", "capture_graphs", "fake_world", "predict_step", "schedule_graphs"]


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


class _MetaRunner(torch.fx.Interpreter):
    """Runs a captured graph, also on meta tensors. The RNG-state wrappers the partitioner puts around
    a random op that activation checkpointing recomputes (flash attention counts as one) have no meta
    kernel: on meta, the op runs unwrapped and an empty tensor stands for the state."""

    def call_function(self, target, args, kwargs):
        if target is run_and_save_rng_state and _on_meta(args):
            return torch.empty(0, dtype=torch.uint8, device="meta"), args[0](*args[1:], **kwargs)
        if target is run_with_rng_state and _on_meta(args[2:]):
            return args[1](*args[2:], **kwargs)
        return super().call_function(target, args, kwargs)


def _on_meta(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in torch.utils._pytree.tree_leaves(args))


def capture_graphs(
    model: torch.nn.Module,
    *args: Any,
    memory_budget_bytes: Optional[int] = None,
    loss: Callable[[Any], torch.Tensor] = lambda output: output.sum(),
    repeated_blocks: Optional[torch.nn.ModuleList] = None,
    activation_checkpointing: Optional[str] = None,
) -> dict[str, GraphModule]:
    """Compile `model(*args)` and `loss(output).backward()` once; returns {"forward": ...,
    "backward": ...}: the graphs after the backend's joint passes (selective unsharding under
    `memory_budget_bytes`, resharding after forward, the checkpoint policy `activation_checkpointing`,
    which with "auto" the budget chooses)
    and its partitioner, before scheduling.
    Nothing is computed: the graphs are only captured, so the inputs may be on the meta device.

    `repeated_blocks`, the model's list of blocks alike in code, shapes and sharding (each a
    `fully_shard` group of its own, as a Llama's layers): the trace then runs only the first three
    and the last, and the graphs hold all of them, stamped out from the third ([Note: Stamping
    blocks] in passes/stamp.py). The trace of a deep model costs four blocks' time instead of all
    of theirs. Raises `ValueError` where the traced blocks do not trace alike; blocks that differ
    in a way the four traced ones do not show (every fourth layer another attention) must be
    captured whole. The model's list is as it was afterwards."""
    config = BackendConfig(memory_budget_bytes=memory_budget_bytes, activation_checkpointing=activation_checkpointing)
    try:
        return _capture(model, args, config, loss, repeated_blocks)
    except Exception as error:
        if checkpoint_to_fit(error) is None:  # [Note: Checkpointing to fit a budget] in passes/checkpoint_policy.py
            raise
        return _capture(model, args, replace(config, activation_checkpointing="save_matmuls"), loss, repeated_blocks)


def _capture(model: torch.nn.Module, args: tuple, config: BackendConfig, loss: Callable[[Any], torch.Tensor],
             repeated_blocks: Optional[torch.nn.ModuleList]) -> dict[str, GraphModule]:
    """`capture_graphs` with the backend's `config`."""
    activation_checkpointing = config.activation_checkpointing
    joint_passes = PassPipeline("joint", config.passes(Stage.JOINT), frozenset(), None)
    graphs: dict[str, GraphModule] = {}
    stamped: dict[str, GraphModule] = {}
    stamping = repeated_blocks is not None and len(repeated_blocks) > _TRACED_BLOCKS
    if stamping:
        blocks_path = _path_of(model, repeated_blocks)
        group_names = [_group_name(block, f"{blocks_path}.{i}") for i, block in enumerate(repeated_blocks)]

    def partition_joint(joint_gm, joint_inputs, **kwargs):
        if not stamping:
            return partition(joint_passes(joint_gm, "graph"), joint_inputs,
                             checkpoint_policy=activation_checkpointing, **kwargs)
        if not stamped:
            joint = _copy_of(joint_gm)
            static = stamp_blocks(joint, blocks_path, group_names, kwargs["num_fwd_outputs"],
                                  kwargs.get("static_lifetime_input_indices"))
            stamped["forward"], stamped["backward"] = partition(
                joint_passes(joint, "graph"), joint_inputs, checkpoint_policy=activation_checkpointing,
                **{**kwargs, "static_lifetime_input_indices": static})
        # what runs: the traced blocks only
        return partition(joint_gm, joint_inputs, checkpoint_policy=activation_checkpointing, **kwargs)

    def keep(kind: str):
        def compile_graph(gm: GraphModule, _inputs):
            graphs[kind] = gm
            return make_boxed_func(lambda *args: _MetaRunner(gm).run(*args))

        return compile_graph

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"), partition_fn=partition_joint,
                           keep_inference_input_mutations=True)
    setattr(backend, SCOPE_ATTR, "step")  # the hooks traced into the graph: [Note: Compile scope]
    torch._dynamo.reset()
    with capturing_graphs(model), _traced_blocks(repeated_blocks if stamping else None):
        try:
            loss(torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args)).backward()
        except torch._dynamo.exc.BackendCompilerFailed as error:
            if isinstance(error.inner_exception, ValueError):  # the blocks cannot be stamped: say so plainly
                raise error.inner_exception from None
            raise
    torch._dynamo.reset()
    return stamped or graphs


_TRACED_BLOCKS = 4  # the first three blocks and the last: [Note: Stamping blocks]


@contextmanager
def _traced_blocks(blocks: Optional[torch.nn.ModuleList]) -> Iterator[None]:
    """`blocks` holding only the first three of its blocks and its last, for the trace."""
    if blocks is None:
        yield
        return
    saved = blocks._modules
    kept = [*list(blocks)[:_TRACED_BLOCKS - 1], blocks[-1]]
    blocks._modules = dict((str(i), block) for i, block in enumerate(kept))
    try:
        yield
    finally:
        blocks._modules = saved


def _copy_of(gm: GraphModule) -> GraphModule:
    """A copy of `gm` to change: its own nodes (and their meta dicts), the same fake tensors."""
    graph = torch.fx.Graph()
    value, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(value).meta = dict(output.meta)
    return GraphModule(gm, graph)


def _path_of(model: torch.nn.Module, blocks: torch.nn.Module) -> str:
    path = next((name for name, module in model.named_modules() if module is blocks), None)
    if not path:
        raise ValueError("repeated_blocks must be a list of blocks inside the model (e.g. model.layers)")
    return path


def _group_name(block: torch.nn.Module, fqn: str) -> str:
    state = getattr(block, "_fsdp_state", None)
    if not isinstance(state, FSDPState) or state.group is None or len(state.modules) != 1 or state.modules[0] is not block:
        raise ValueError(f"repeated_blocks: {fqn} is not a fully_shard group of its own; call fully_shard on each block")
    return state.group.name


def schedule_graphs(graphs: dict[str, GraphModule], **options: Any) -> dict[str, GraphModule]:
    """Copies of `capture_graphs`' graphs run through the backend's scheduling passes, as
    `fsdp_graph.backend(**options)` schedules them (`disabled_passes`, `hardware_profile`, which
    may also be a `CostModel` with a link per parallelism, and the other pass options)."""
    config = BackendConfig(compiler=Compiler.AOT_EAGER, **options)
    schedule = PassPipeline(Stage.SCHEDULE.value, config.passes(Stage.SCHEDULE), config.disabled_passes, None)
    return {kind: schedule(copy.deepcopy(gm), kind) for kind, gm in graphs.items()}


@dataclass
class StepPrediction:
    """One training step predicted from its forward and backward graphs.

    Attributes:
        step_s: forward plus backward, each as `simulate` runs it.
        exposed_s: communication the compute streams waited for, both graphs.
        comm_s / exposed_s_by: communication time, and its exposed part, per parallelism ("fsdp",
            "tp").
        num_collectives: collectives per parallelism.
        peak_bytes: `resident_bytes` plus the larger of the forward's peak (what it allocates, the
            activations it saves for backward included) and the backward's (those saved activations
            from its start until their last use, plus what it allocates; recomputed activations
            included).
        peak_graph: "forward" or "backward", where the peak is.
        simulations: the `Simulation` of each graph.
    """

    step_s: float
    exposed_s: float
    comm_s: dict[str, float]
    exposed_s_by: dict[str, float]
    num_collectives: dict[str, int]
    peak_bytes: int
    peak_graph: str
    simulations: dict[str, Simulation] = field(default_factory=dict)

    def share(self, parallelism: Optional[str] = None) -> float:
        """Exposed communication (of one parallelism, or all) as a fraction of the step."""
        exposed = self.exposed_s if parallelism is None else self.exposed_s_by.get(parallelism, 0.0)
        return exposed / self.step_s if self.step_s else 0.0


def predict_step(graphs: dict[str, GraphModule], cost_model: CostModel, resident_bytes: int = 0) -> StepPrediction:
    """Simulate the (scheduled) forward and backward graphs `capture_graphs` returned, on
    `cost_model`'s machine; `resident_bytes` is what lives through the step outside the graphs
    (sharded parameters, gradients, optimizer states)."""
    comm, exposed_by = defaultdict(float), defaultdict(float)
    count = defaultdict(int)
    sims, peaks = {}, {}
    for kind, gm in graphs.items():
        program = program_of(gm)
        sims[kind] = sim = simulate(program, cost_model)
        for c in sim.collectives:
            comm[c.parallelism] += c.busy_s
            exposed_by[c.parallelism] += c.exposed_s
            count[c.parallelism] += 1
        peaks[kind] = sim.memory.peak_bytes
    peak_graph = max(peaks, key=peaks.__getitem__)
    return StepPrediction(
        step_s=sum(s.total_s for s in sims.values()), exposed_s=sum(s.exposed_comm_s for s in sims.values()),
        comm_s=dict(comm), exposed_s_by=dict(exposed_by), num_collectives=dict(count),
        peak_bytes=resident_bytes + peaks[peak_graph], peak_graph=peak_graph, simulations=sims,
    )
