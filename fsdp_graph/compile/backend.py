"""The `fsdp_graph` compile backend: AOTAutograd with our joint-graph passes, then an inner compiler.

    torch.compile(model, backend="fsdp_graph")                           # Inductor, defaults
    torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir="dump"))

Dynamo traces each group's unshard into the graph (runtime/traced.py). This backend runs the joint
forward-backward graph through the pass pipeline (passes/), partitions it with the min-cut
partitioner (fsdp_graph/compile/partition.py), and hands forward and backward to Inductor or to plain eager execution (`aot_eager`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from importlib.metadata import entry_points
from typing import Any, Callable, Optional

import torch
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import GraphModule

from .agreement import AGREEMENT
from .cache_key import local_shapes, own_sources_digest, stable_cache_keys
from ..inspect.dump import GraphDump, count_ops
from .partition import InductorPartitioner, partition
from ..passes.check_collectives import check_collectives
from ..passes.nodes import fsdp_meta, is_region_call
from ..passes.cost_model import CostModel, Profile
from ..passes.pipeline import GraphPass, PassPipeline
from ..passes.reshard import tag_reshard_after_forward
from ..passes.unshard_selection import select_unsharded
from ..passes.async_tp import DEFAULT_NUM_CHUNKS, async_tp_on_cuda
from ..passes.gloo import plain_all_gathers_on_gloo, reduce_scatters_in_place_on_gloo
from ..passes.scheduling import CROSS_GROUP_PASS_NAMES, PIN_ORDER, SCHEDULING_PASS_NAMES, scheduling_passes
from ..api.scope import SCOPE_ATTR, SCOPES
from ..runtime.meta import GROUP_KEY
from ..runtime.param import OWNER_ATTR
from ..runtime.param_group import ParamGroup

logger = logging.getLogger(__name__)

BACKEND_NAME = "fsdp_graph"
DUMP_ENV = "FSDP_GRAPH_DUMP"  # read when a backend with no dump_dir compiles a graph
# Read when a backend whose check_collectives is None compiles a graph; "1" turns the checks on.
CHECK_COLLECTIVES_ENV = "FSDP_GRAPH_CHECK_COLLECTIVES"
TRACE_ENV = "TORCH_TRACE"  # torch's structured trace (tlparse): the dump goes there too, see fsdp_graph/inspect/dump.py

# Joint-graph passes, in order (`BackendConfig.joint_passes`). Names are what `disabled_passes` accepts.
JOINT_PASS_NAMES = ("unshard_selection", "reshard_after_forward")


class Compiler(Enum):
    """What compiles the partitioned forward and backward graphs."""

    INDUCTOR = "inductor"  # Inductor (C++/Triton kernels); the collectives stay extern calls
    AOT_EAGER = "aot_eager"  # run the graphs op by op: same numbers as eager, for debugging


@dataclass(frozen=True)
class BackendConfig:
    """How the `fsdp_graph` backend compiles.

    Attributes:
        compiler: the inner compiler, a `Compiler` or its value ("inductor", "aot_eager").
        dump_dir: write every graph around every pass, and summary.json, here. None: use the
            `FSDP_GRAPH_DUMP` environment variable if set, else dump nothing. Under `TORCH_TRACE`
            the graphs and the summary also go into torch's structured trace (for tlparse).
        disabled_passes: names of passes to skip (see `JOINT_PASS_NAMES`), e.g. to compare graphs or
            numbers with and without one. Skipping "reshard_after_forward" keeps every group's
            unsharded parameters from forward to backward. The scheduling passes of the forward and
            backward graphs (passes/scheduling.py) are "merge_tp_all_reduces", "async_tp", "bucket_by_group",
            "auto_bucket", "reorder_for_overlap", "overlap_tp_all_reduces" and "pin_order".
        hardware_profile: the cost model's machine: a name ("h100-nvlink", "h100-infiniband",
            "cpu-gloo") or a `HardwareProfile` (e.g. from `passes.cost_model.calibrate`). None:
            "h100-nvlink" when CUDA is available, else "cpu-gloo".
        bucket_cap_bytes: auto-bucketing merges latency-bound buckets up to this size and splits
            larger buckets.
        max_bytes_in_flight: the most collective bytes issued and not yet waited on; None: no limit.
        max_collectives_in_flight: the most collectives issued and not yet waited on; None: no
            limit (gloo included: its all-gathers go through gloo's plain allgather, see
            [Note: All-gathers on gloo] in passes/gloo.py).
        memory_budget_bytes: the predicted peak memory a step may hold above its start, when
            reordering: what a graph allocates, and in a backward also the activations its
            forward saved (parameters, optimizer state and the batch are not counted); prefetch
            gets shallower to stay within it. None: the unscheduled peak plus two of the largest
            buckets. Given explicitly, it is also the budget for
            keeping groups unsharded from forward to backward ("unshard_selection",
            passes/unshard_selection.py): it then overrides `reshard_after_forward=True`.
        rank_divergent_graphs: the ranks may compile different graphs for one step: Python in the
            forward that depends on the rank, or a graph break or recompile limit reached on some
            ranks only. Then a group traced on one rank can run on the eager hooks on another, and
            only a schedule that keeps every group's collectives on their own and in program order
            puts the same collectives on the wire on both ([Note: Fallback groups keep the traced
            order] in runtime/traced.py): the passes that merge or reorder collectives of several
            groups ("auto_bucket", "reorder_for_overlap") are left out, at the cost of their overlap.
            Graphs of one group each (every expert call a frame of its own) need no such care.
            False: the ranks compare their graphs while compiling, and a graph of several groups
            that differs between them gets the same treatment ([Note: Ranks that compile different
            graphs] in fsdp_graph/compile/agreement.py).
        async_tp_chunks: the row chunks each tensor-parallel matmul -> all-reduce is split into, so
            that each chunk's all-reduce runs behind the next chunk's matmul ("async_tp",
            passes/async_tp.py); 1 leaves them whole, as does disabling "async_tp".
        scope: what one compiled graph spans ([Note: Compile scope] in fsdp_graph/api/scope.py).
            "step" (default): a sharded module's hooks are traced into the graph of the code that calls
            it, so the whole step is one graph and its collectives are the passes' to bucket, reorder
            and reshard. "block": FSDP2's way: every sharded module's hooks run on the eager runtime
            (one bucket per group, prefetched), and Dynamo compiles the code between them, so
            blocks of the same code share one compiled graph and the compile time stays flat in
            depth; cross-group bucketing, the reordered schedule and selective unsharding are
            then left out.
        check_collectives: check at run time that no buffer of an in-flight collective is written,
            freed or resized before its wait, and raise `CollectiveBufferError` naming it if so
            ([Note: Checking in-flight collectives] in passes/check_collectives.py); a copy of
            every collective input per step, for debugging. None: on when the
            `FSDP_GRAPH_CHECK_COLLECTIVES` environment variable is "1".
    """

    compiler: Compiler = Compiler.INDUCTOR
    dump_dir: Optional[str] = None
    disabled_passes: frozenset[str] = field(default_factory=frozenset)
    hardware_profile: Any = None
    bucket_cap_bytes: int = 1 << 30
    max_bytes_in_flight: Optional[int] = None
    max_collectives_in_flight: Optional[int] = None
    memory_budget_bytes: Optional[int] = None
    rank_divergent_graphs: bool = False
    async_tp_chunks: int = DEFAULT_NUM_CHUNKS
    check_collectives: Optional[bool] = None
    scope: str = "step"

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.compiler, str):
            choices = [c.value for c in Compiler]
            if self.compiler not in choices:
                problems.append(f"compiler={self.compiler!r} is not one of {choices}")
            else:
                object.__setattr__(self, "compiler", Compiler(self.compiler))
        elif not isinstance(self.compiler, Compiler):
            problems.append(f"compiler must be a Compiler or a string, got {type(self.compiler).__name__}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            problems.append(f"dump_dir must be a path or None, got {type(self.dump_dir).__name__}")
        if isinstance(self.disabled_passes, str) or not isinstance(self.disabled_passes, (set, frozenset, list, tuple)):
            problems.append(
                f"disabled_passes must be a collection of pass names, got {self.disabled_passes!r}; "
                f"e.g. disabled_passes={{'reshard_after_forward'}}"
            )
        else:
            known = list(JOINT_PASS_NAMES) + list(SCHEDULING_PASS_NAMES)
            for name in self.disabled_passes:
                if name not in known:
                    problems.append(f"disabled_passes names {name!r}, which is not a pass; passes: {known}")
            object.__setattr__(self, "disabled_passes", frozenset(self.disabled_passes))
        problems += self._scheduling_problems()
        if self.scope not in SCOPES:
            problems.append(f"scope must be one of {list(SCOPES)}, got {self.scope!r}")
        if self.check_collectives not in (None, True, False):
            problems.append(f"check_collectives must be True, False or None, got {self.check_collectives!r}")
        if problems:
            raise ValueError("Invalid fsdp_graph backend config:\n" + "\n".join(f"  - {p}" for p in problems))

    def _scheduling_problems(self) -> list[str]:
        problems = []
        try:
            self.cost_model()
        except ValueError as error:
            problems.append(str(error))
        if not isinstance(self.bucket_cap_bytes, int) or self.bucket_cap_bytes <= 0:
            problems.append(f"bucket_cap_bytes must be a positive int, got {self.bucket_cap_bytes!r}")
        if not isinstance(self.rank_divergent_graphs, bool):
            problems.append(f"rank_divergent_graphs must be a bool, got {self.rank_divergent_graphs!r}")
        for name in ("max_bytes_in_flight", "memory_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                problems.append(f"{name} must be a non-negative int or None, got {value!r}")
        value = self.max_collectives_in_flight
        if value is not None and (not isinstance(value, int) or value < 1):
            problems.append(f"max_collectives_in_flight must be a positive int or None, got {value!r}")
        value = self.async_tp_chunks
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"async_tp_chunks must be a positive int (1: no chunks), got {value!r}")
        return problems

    def cost_model(self) -> CostModel:
        profile = self.hardware_profile
        if profile is None:
            profile = Profile.H100_NVLINK if torch.cuda.is_available() else Profile.CPU_GLOO
        return CostModel(profile)

    def joint_passes(self) -> list[GraphPass]:
        select = functools.partial(select_unsharded, memory_budget_bytes=self.memory_budget_bytes)
        return [GraphPass("unshard_selection", select), GraphPass("reshard_after_forward", tag_reshard_after_forward)]

    def scheduling_passes(self) -> list[GraphPass]:
        passes = scheduling_passes(
            self.cost_model(), self.bucket_cap_bytes, self.max_bytes_in_flight, self.memory_budget_bytes,
            self.max_collectives_in_flight, self.async_tp_chunks,
        )
        if self.rank_divergent_graphs:
            passes = [p for p in passes if p.name not in CROSS_GROUP_PASS_NAMES]
        return passes

    def check_passes(self) -> list[GraphPass]:
        """Debug passes run on the scheduled forward and backward graphs, after the program for the
        inspector is written (they add no collective and move none)."""
        return [GraphPass("check_collectives", check_collectives)] if self.checking_collectives() else []

    def checking_collectives(self) -> bool:
        """Whether compiled graphs get the in-flight collective checks (`check_collectives`)."""
        if self.check_collectives is not None:
            return self.check_collectives
        return os.environ.get(CHECK_COLLECTIVES_ENV) == "1"

    @classmethod
    def from_options(cls, options: Optional[dict[str, Any]]) -> "BackendConfig":
        """From `torch.compile(..., options={...})`: the same names as the attributes."""
        options = dict(options or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(
                f"Unknown fsdp_graph backend option(s) {unknown}; valid options: {sorted(names)}"
            )
        return cls(**options)


def _graph_id() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return "graph"
    return f"frame_{compile_id.frame_id}_{compile_id.frame_compile_id}"


def _ranks_of(owners: list) -> list[int]:
    """The ranks of the meshes the graph's sharded parameters live on."""
    return sorted({r for o in owners for r in o.mesh_info.ranks})


def _sharded_param_of(t: Any):
    """The `ShardedParam` a graph input belongs to: a sharded parameter, or an unsharded one that
    the eager runtime reduces (a group that fell back); None for anything else."""
    owner = getattr(t, OWNER_ATTR, None)
    if owner is not None:
        return owner
    for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
        group = getattr(hook, "__self__", None)
        if isinstance(group, ParamGroup):
            return group.params[0]
    return None


def _check_sharded(gm: GraphModule, example_inputs: list) -> list:
    """Raise if the graph reads parameters but none of them is fsdp_graph's; return the owners."""
    owners = [o for o in map(_sharded_param_of, example_inputs) if o is not None]
    traced_groups = any(fsdp_meta(n, GROUP_KEY) for n in gm.graph.nodes)
    has_params = any(isinstance(t, torch.nn.Parameter) for t in example_inputs)
    if has_params and not owners and not traced_groups:
        raise ValueError(
            f"backend={BACKEND_NAME!r} got a graph whose parameters were never sharded; apply "
            f"fsdp_graph.fully_shard to the model first (each block, then the root), then "
            f"torch.compile(model, backend={BACKEND_NAME!r}); for an unsharded model use "
            f"backend='inductor'"
        )
    return owners


class FSDPGraphBackend:
    """A configured backend: `torch.compile(model, backend=FSDPGraphBackend(config))`."""

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        setattr(self, SCOPE_ATTR, config.scope)  # read while Dynamo traces: fsdp_graph/api/scope.py

    def __repr__(self) -> str:
        return f"FSDPGraphBackend({self.config})"

    def _dump(self) -> Optional[GraphDump]:
        directory = self.config.dump_dir or os.environ.get(DUMP_ENV)
        structured_trace = bool(os.environ.get(TRACE_ENV))
        if not directory and not structured_trace:
            return None
        return GraphDump(directory or None, structured_trace)

    def __call__(self, gm: GraphModule, example_inputs: list) -> Callable:
        owners = _check_sharded(gm, example_inputs)
        if not self.config.rank_divergent_graphs and AGREEMENT.diverged(gm, example_inputs, _ranks_of(owners)):
            # [Note: Ranks that compile different graphs] in fsdp_graph/compile/agreement.py
            return FSDPGraphBackend(replace(self.config, rank_divergent_graphs=True))(gm, example_inputs)
        graph_id = _graph_id()
        dump = self._dump()
        joint = PassPipeline("joint", self.config.joint_passes(), self.config.disabled_passes, dump)
        logger.debug("fsdp_graph::compile (%s) with %s", graph_id, self.config.compiler.value)
        if dump is not None:
            dump.write_graph(gm, f"{graph_id}.dynamo")
        if self.config.compiler is Compiler.AOT_EAGER:
            compiled = self._aot_eager(gm, example_inputs, graph_id, joint, dump)
        else:
            compiled = self._inductor(gm, example_inputs, graph_id, joint, dump)
        if dump is None:
            return compiled
        return _RecordFallbacks(compiled, owners, dump)

    def _aot_eager(self, gm, example_inputs, graph_id, joint: PassPipeline, dump: Optional[GraphDump]):
        from torch._dynamo.backends.common import aot_autograd

        def partition_joint(joint_gm, joint_inputs, **kwargs):
            return partition(joint(joint_gm, graph_id), joint_inputs, **kwargs)

        schedule = PassPipeline("schedule", self.config.scheduling_passes(), self.config.disabled_passes, dump)
        checks = PassPipeline("schedule", self.config.check_passes(), self.config.disabled_passes, dump)

        def inner(kind: str):
            def compile_graph(graph: GraphModule, _inputs):
                _log_graph(graph_id, kind, graph, dump)
                graph = _schedule(schedule, graph_id, kind, graph, dump)
                graph = checks(graph, f"{graph_id}.{kind}")
                return make_boxed_func(graph.forward)

            return compile_graph

        return aot_autograd(
            fw_compiler=inner("forward"),
            bw_compiler=inner("backward"),
            partition_fn=partition_joint,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def _inductor(self, gm, example_inputs, graph_id, joint: PassPipeline, dump: Optional[GraphDump]):
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = {
            "joint_custom_pre_pass": _InductorJointPass(
                joint, graph_id, dump is not None, self.config.memory_budget_bytes, local_shapes(example_inputs)
            ),
            "custom_partitioner_fn": InductorPartitioner(),
        }
        if "async_tp" not in self.config.disabled_passes:
            patches.update(async_tp_on_cuda(example_inputs))
        # pin_order runs after the program is written for the inspector: its control_deps wrappers
        # would hide the collectives and waits from it, and it changes no order. The checks go
        # before it, so the order it pins keeps each check between its collective and the wait.
        disabled = self.config.disabled_passes
        schedule = PassPipeline("schedule", self.config.scheduling_passes(), disabled, dump)
        pin = PassPipeline("schedule", self.config.check_passes() + [PIN_ORDER], disabled, dump)
        patches["post_grad_custom_post_pass"] = _InductorLogPass(graph_id, dump, schedule, pin, self.config)
        if "pin_order" not in disabled:
            # [Note: Inductor keeps the planned order]
            # Our passes place every collective and wait within a memory budget that the simulator
            # checks in graph order, and pin_order makes the collectives' places binding. Inductor's
            # own `reorder_for_peak_memory` still moved the compute between them: it postponed
            # gradient matmuls whose outputs live to the end, and with them the all-gather and
            # reduce-scatter pinned next to them, so the gradient buckets of two blocks were alive
            # at once (a kept block's step measured 38.6 MiB at a predicted 29.7; 34.8 with the
            # pass off, 30.8-32.5 at 30.5 once gloo's copies were modeled). Its model knows neither
            # gloo's copies nor our budget; ours does, so it decides.
            patches["reorder_for_peak_memory"] = False
            # Inductor's buffer reuse keeps a freed buffer alive until a later buffer of the same
            # size takes it over: a block's packed gradients held from its reduce-scatter's wait
            # until the next all-gather's output, gathered blocks held between their all-gathers
            # (GPT-NeoX at a 23 MiB budget measured 25.3 MiB against 22.8 predicted; 22.8 without
            # reuse, at the same step time). The budget is planned on freeing at last use.
            patches["allow_buffer_reuse"] = False
        if any(is_region_call(n) for n in gm.graph.nodes):  # torch 2.13 reuses a region's buffers wrongly on CPU:
            patches["allow_buffer_reuse"] = False  # examples/repro/nested_region_inductor_grads.py
        with stable_cache_keys():  # see [Note: Rank-independent cache keys]
            return compile_fx(gm, example_inputs, config_patches=patches)


def _log_graph(graph_id: str, kind: str, gm: GraphModule, dump: Optional[GraphDump]) -> None:
    logger.debug("fsdp_graph::graph (%s.%s) %s", graph_id, kind, count_ops(gm))
    if dump is not None:
        dump.write_graph(gm, f"{graph_id}.{kind}")
        dump.record_graph(graph_id, kind, gm)


class _InductorJointPass(CustomGraphPass):
    """Runs the joint pipeline inside Inductor. A stable `uuid` keeps the FX graph cache usable; when
    dumping, None disables the cache so every graph is written."""

    def __init__(
        self, pipeline: PassPipeline, graph_id: str, dumping: bool, memory_budget_bytes: Optional[int], shapes: str
    ) -> None:
        self.pipeline = pipeline
        self.shapes = shapes  # the local shard shapes; see [Note: Rank-independent cache keys]
        self.graph_id = graph_id
        self.dumping = dumping
        self.memory_budget_bytes = memory_budget_bytes  # unshard_selection's choices depend on it

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.pipeline(graph.owning_module, self.graph_id)

    def uuid(self) -> Optional[str]:
        if self.dumping:
            return None
        return (f"fsdp_graph.joint:{own_sources_digest()[:16]}:{','.join(self.pipeline.names)}:"
                f"off={','.join(sorted(self.pipeline.disabled))}:{self.memory_budget_bytes}:{self.shapes}")


class _InductorLogPass(CustomGraphPass):
    """Dumps the forward and backward graphs as Inductor is about to lower them, then schedules them."""

    def __init__(
        self, graph_id: str, dump: Optional[GraphDump], schedule: PassPipeline, pin: PassPipeline, config: BackendConfig
    ) -> None:
        self.graph_id = graph_id
        self.dump = dump
        self.schedule = schedule
        self.pin = pin
        self.config = config

    def __call__(self, graph: torch.fx.Graph) -> None:
        is_backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        kind = "backward" if is_backward else "forward"
        if self.dump is not None:
            _log_graph(self.graph_id, kind, graph.owning_module, self.dump)
        gm = _schedule(self.schedule, self.graph_id, kind, graph.owning_module, self.dump)
        # Inductor only: aot_eager keeps gloo's reduce-scatters as traced, op for op like eager mode.
        gm = reduce_scatters_in_place_on_gloo(gm)  # [Note: Reduce-scatters on gloo]
        self.pin(gm, f"{self.graph_id}.{kind}")

    def uuid(self) -> Optional[str]:
        if self.dump is not None:
            return None
        c = self.config
        names = self.schedule.names + self.pin.names
        return (
            f"fsdp_graph.schedule:{own_sources_digest()[:16]}:{','.join(names)}:"
            f"off={','.join(sorted(self.schedule.disabled))}:{c.cost_model().profile}:{c.bucket_cap_bytes}:"
            f"{c.max_bytes_in_flight}:{c.max_collectives_in_flight}:{c.memory_budget_bytes}:{c.async_tp_chunks}"
        )


def _schedule(schedule: PassPipeline, graph_id: str, kind: str, gm: GraphModule, dump: Optional[GraphDump]) -> GraphModule:
    """Run the scheduling passes on a forward or backward graph; when dumping, write its program
    for `python -m fsdp_graph.inspect` (see fsdp_graph/inspect/timeline.py)."""
    from ..inspect.timeline import write_program

    gm = schedule(gm, f"{graph_id}.{kind}")
    gm = plain_all_gathers_on_gloo(gm)  # [Note: All-gathers on gloo]
    if dump is not None and dump.directory is not None:
        write_program(dump.directory, f"{graph_id}.{kind}", gm)
    return gm


class _RecordFallbacks:
    """Wraps a compiled graph while dumping: after each call, writes new fallbacks of its roots."""

    def __init__(self, compiled: Callable, owners: list, dump: GraphDump) -> None:
        self.compiled = compiled
        self.dump = dump
        self.roots = []
        for owner in owners:
            ctx = owner.group_modules[0]._fsdp_state.ctx
            if all(ctx is not r for r in self.roots):
                self.roots.append(ctx)
        self._num_written = -1
        # Dynamo calls a compiled graph with boxed inputs when the callable says so.
        self._boxed_call = getattr(compiled, "_boxed_call", False)

    def __call__(self, *args):
        out = self.compiled(*args)
        fallbacks = {name: reason for ctx in self.roots for name, reason in ctx.fallbacks.items()}
        if len(fallbacks) != self._num_written:
            self.dump.record_fallbacks(fallbacks)
            self._num_written = len(fallbacks)
        return out


def backend(config: Optional[BackendConfig] = None, **options: Any) -> FSDPGraphBackend:
    """A configured `fsdp_graph` backend: pass a `BackendConfig`, or its fields as keywords.

        torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir="dump"))
    """
    if config is not None and options:
        raise TypeError("fsdp_graph.backend takes a BackendConfig or keyword options, not both")
    if config is not None and not isinstance(config, BackendConfig):
        raise TypeError(f"config must be a BackendConfig, got {type(config).__name__}")
    return FSDPGraphBackend(config or BackendConfig.from_options(options))


def fsdp_graph_backend(gm: GraphModule, example_inputs: list, options: Optional[dict[str, Any]] = None) -> Callable:
    """The backend registered as "fsdp_graph"; `torch.compile(..., options={...})` configures it."""
    return FSDPGraphBackend(BackendConfig.from_options(options))(gm, example_inputs)


setattr(fsdp_graph_backend, SCOPE_ATTR, BackendConfig.scope)  # unless options= say otherwise


def _register() -> None:
    # Installed packages register through the `torch_dynamo_backends` entry point, which Dynamo
    # loads (and registers) on first lookup; registering here too would be a duplicate. A source
    # checkout on sys.path has no entry point, so it registers on import.
    if not entry_points(group="torch_dynamo_backends", name=BACKEND_NAME):
        torch._dynamo.register_backend(fsdp_graph_backend, name=BACKEND_NAME)


_register()
