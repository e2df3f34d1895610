"""The `fsdp_graph` compile backend: AOTAutograd with our joint-graph passes, then an inner compiler.

    torch.compile(model, backend="fsdp_graph")                           # Inductor, defaults
    torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager", dump_dir="dump"))

Dynamo traces each group's unshard into the graph (traced/unshard.py). This backend runs the joint
forward-backward graph through the pass pipeline (passes/), partitions it with the min-cut
partitioner (fsdp_graph/compile/partition.py), and hands forward and backward to Inductor or to plain eager execution (`aot_eager`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import textwrap
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from importlib.metadata import entry_points
from typing import Any, Callable, Optional

import torch
from torch._functorch import config as functorch_config
from torch.utils import _pytree as pytree
from torch._dynamo.backends.debugging import AOTEagerOutputCode, boxed_nop
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import GraphModule

from . import agreement
from .agreement import FrameWireOrder
from .cpu_probe import start_cpu_probe, wait_for_cpu_probe
from .cache_key import KeyOnly, beside_caches_file, hash_checkpoint_policies, local_shapes, own_sources_digest, stable_cache_keys
from ..inspect.dump import GraphDump, count_ops
from .partition import InductorPartitioner, forget_partitioned_regions, partition
from .pieces import compile_in_pieces, inline_regions
from .option_docs import field_docs
from .owners import RecordFallbacks, owners_of
from .region_schema import region_schemas_once
from ..passes.nodes import fsdp_meta, is_backward_graph, is_region_call
from ..passes.pipeline import GraphPass, PassPipeline
from ..passes.async_tp import async_tp_on_cuda
from ..passes.checkpoint_policy import checkpoint_to_fit
from ..passes import table as pass_table
from ..passes.table import OPTIONS, PASS_NAMES, Stage
from ..passes.unshard_selection import FIRST_BACKWARD_GATHERS_META
from ..traced.scope import REGIONS, REGIONS_ATTR, SCOPE_ATTR, SCOPES, Regions, Scope
from ..runtime.meta import GROUP_KEY

logger = logging.getLogger(__name__)

BACKEND_NAME = "fsdp_graph"
DUMP_ENV = "FSDP_GRAPH_DUMP"  # read when a backend with no dump_dir compiles a graph
TRACE_ENV = "TORCH_TRACE"  # torch's structured trace (tlparse): the dump goes there too, see fsdp_graph/inspect/dump.py


class Compiler(Enum):
    """What compiles the partitioned forward and backward graphs."""

    INDUCTOR = "inductor"  # Inductor (C++/Triton kernels); the collectives stay extern calls
    AOT_EAGER = "aot_eager"  # run the graphs op by op: same numbers as eager, for debugging


def _with_pass_options(cls: type) -> type:
    """Give the config class a field, with its default and its docs, for every option a pass of
    the table reads (passes/table.py), and an `Attributes:` section made of every field's docs (the
    string under each field of the class body; fsdp_graph/compile/option_docs.py). Runs before
    `dataclass`, which then makes them fields."""
    own = field_docs(cls)
    for option in OPTIONS:
        cls.__annotations__[option.name] = "Any"
        setattr(cls, option.name, option.default)
    attributes = "".join(
        textwrap.fill(f"{name}: {doc}", 104, initial_indent=" " * 8, subsequent_indent=" " * 12,
                      break_on_hyphens=False) + "\n"
        for name, doc in own.items()
    )
    cls.__doc__ = (cls.__doc__.rstrip() + "\n\n    Attributes:\n" + attributes
                   + pass_table.format_options(indent=8) + "    ")
    return cls


@dataclass(frozen=True)
@_with_pass_options
class BackendConfig:
    """How the `fsdp_graph` backend compiles: the options of `fsdp_graph.backend(...)` and of
    `torch.compile(model, backend="fsdp_graph", options={...})`, one field each (docs/compiler.md's
    options table is made from them: `python tools/options_table.py`). The options the
    passes read come last, from the pass table (`Option`s of passes/table.py)."""

    compiler: Compiler = Compiler.INDUCTOR
    """The inner compiler, a `Compiler` or its value: "inductor" compiles the partitioned forward
    and backward graphs to kernels; "aot_eager" runs them op by op, the same numbers as the eager
    runtime: for debugging, and the fast compile (our passes schedule the step, no kernel is
    compiled) for debug loops, short jobs and new models (docs/compiler.md, "Fast compile")."""

    dump_dir: Optional[str] = None
    """Write every graph around every pass, the seconds each pass took, and summary.json, here, for
    `python -m fsdp_graph.inspect`. None: use the `FSDP_GRAPH_DUMP` environment variable if set,
    else dump nothing. Under `TORCH_TRACE` the graphs and the summary also go into torch's
    structured trace (for tlparse)."""

    disabled_passes: frozenset[str] = field(default_factory=frozenset)
    """Names of passes to skip, e.g. to compare graphs or numbers with and without one: the rows
    of the pass table (`python -m fsdp_graph.inspect --passes` prints it). Skipping
    "reshard_after_forward" keeps every group's unsharded parameters from forward to backward."""

    rank_divergent_graphs: bool = False
    """The ranks may compile different graphs for one step (Python in the forward that depends on
    the rank, or a graph break or recompile limit reached on some ranks only): leave out the
    passes that merge or reorder collectives of several groups or leave a re-gather out
    ("auto_bucket", "reorder_for_overlap", "unshard_selection"), so that a group traced on one rank
    and run on the eager hooks on another puts the same collectives on the wire ([Note: Fallback
    groups keep the traced order] in traced/hooks.py). False: the ranks compare their graphs
    while compiling, and a graph of several groups that differs between them gets the same
    treatment ([Note: Ranks that compile different graphs] in fsdp_graph/compile/agreement.py)."""

    scope: Scope = "step"
    """What one compiled graph spans ([Note: Compile scope] in traced/scope.py). "step": a
    sharded module's hooks are traced into the graph of the code that calls it, so the whole step
    is one graph and its collectives are the passes' to bucket, reorder and reshard. "block":
    FSDP2's way: every sharded module's hooks run on the eager runtime (one bucket per group,
    prefetched) and Dynamo compiles the code between them, so blocks of the same code share one
    compiled graph; cross-group buckets, the reordered schedule and selective unsharding are left
    out."""

    regions: Regions = "blocks"
    """Which blocks a "step" scope traces as compile regions, so that the graph holds one body for
    all blocks of the same code and shapes, which AOTAutograd and Inductor handle once. "blocks":
    every sharded block that is a group of its own, after the first of each kind (its classes,
    flags, parameter shapes, call layout and the numbers its trace guarded on), which is traced
    inline so that a block that breaks the graph falls back as without regions ([Note: Every block
    a compile region] in traced/regions.py); a graph break inside a later region is torch's
    error. "marked": only blocks whose forward is a `torch.compiler.nested_compile_region`."""

    pieces: bool = True
    """With Inductor, compile the step's forward and backward graphs piece by piece: the
    computation between two collectives is a piece, and pieces of the same structure are compiled
    once, so Inductor's cost stays nearly flat in depth; the collectives run in the scheduled order
    between them ([Note: Pieces between the collectives] in fsdp_graph/compile/pieces.py). Same
    values as one graph, within Inductor's rounding. False: Inductor compiles each graph whole
    (needed by Inductor's own collective passes)."""

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
            for name in self.disabled_passes:
                if name not in PASS_NAMES:
                    problems.append(f"disabled_passes names {name!r}, which is not a pass; passes: {list(PASS_NAMES)}")
            object.__setattr__(self, "disabled_passes", frozenset(self.disabled_passes))
        if not isinstance(self.rank_divergent_graphs, bool):
            problems.append(f"rank_divergent_graphs must be a bool, got {self.rank_divergent_graphs!r}")
        if not isinstance(self.pieces, bool):
            problems.append(f"pieces must be a bool, got {self.pieces!r}")
        if self.scope not in SCOPES:
            problems.append(f"scope must be one of {list(SCOPES)}, got {self.scope!r}")
        if self.regions not in REGIONS:
            problems.append(f"regions must be one of {list(REGIONS)}, got {self.regions!r}")
        problems += pass_table.option_problems(self.option_values())
        if self.activation_checkpointing == "auto" and self.memory_budget_bytes is None:
            problems.append('activation_checkpointing="auto" lets memory_budget_bytes choose: give memory_budget_bytes '
                            '(bytes a step may hold), or choose activation_checkpointing="save_matmuls"')
        if problems:
            raise ValueError("Invalid fsdp_graph backend config:\n" + "\n".join(f"  - {p}" for p in problems))

    def option_values(self) -> dict[str, Any]:
        """The pass options as given, by name."""
        return {option.name: getattr(self, option.name) for option in OPTIONS}

    def resolved_options(self) -> dict[str, Any]:
        """The pass options as the passes get them (`Option.resolve`): e.g. a `CostModel` for
        "hardware_profile", and for "check_collectives" whether the checks are on. Read when a
        graph compiles, since they may depend on the environment."""
        return pass_table.resolve(self.option_values())

    def passes(self, stage: Stage, resolved: Optional[dict[str, Any]] = None, compiler: Optional[Compiler] = None) -> list[GraphPass]:
        """The passes that run at `stage` when `compiler` (default: this config's) compiles, in
        order, with their options bound; `disabled_passes` are still among them (the runner skips
        them and says so)."""
        resolved = self.resolved_options() if resolved is None else resolved
        inductor = (compiler or self.compiler) is Compiler.INDUCTOR
        return pass_table.bound_passes(stage, resolved, inductor=inductor, rank_divergent_graphs=self.rank_divergent_graphs)

    def cache_key(self, stages: tuple[Stage, ...], resolved: dict[str, Any]) -> str:
        """What Inductor's compiled graphs depend on in the passes of `stages` (passes/table.py,
        `cache_key`), for the `uuid`s of the passes Inductor runs."""
        chosen = [s for stage in stages
                  for s in pass_table.specs(stage, resolved, inductor=True, rank_divergent_graphs=self.rank_divergent_graphs)]
        return pass_table.cache_key(chosen, self.disabled_passes, resolved)

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


def _remember_budget_choice(path: Optional[str], over: object) -> None:
    """Write the file of [Note: The budget's choice beside the compile caches]; a cache directory
    that cannot be written only costs the next launch the first trace again."""
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"activation_checkpointing": "save_matmuls", "why": str(over)}, f)
    except OSError as error:
        logger.debug("fsdp_graph: could not keep the budget's choice in %s (%s)", path, error)


def _graph_id() -> str:
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None:
        return "graph"
    return f"frame_{compile_id.frame_id}_{compile_id.frame_compile_id}"


def _check_sharded(gm: GraphModule, example_inputs: list) -> list:
    """Raise if the graph reads parameters but none of them is fsdp_graph's; return the owners."""
    owners = owners_of(example_inputs)
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

    # [Note: Parameters swapped after a compile]
    # After a frame compiles, Dynamo drops the weak references its tracing context keeps to the
    # real tensors it traced, unless the backend is a callable it does not know: a backend built
    # by hand may still read them. Those weak references make `torch.utils.swap_tensors` refuse
    # the parameters ("Cannot swap t1 because it has weakref associated with it"), and swapping is
    # how `module.to(dtype)`, `to_empty` and `load_state_dict` under
    # `torch.__future__.set_swap_module_params_on_conversion(True)` replace DTensor parameters
    # (examples/repro/swap_after_custom_backend.py, torch alone). Our backend reads nothing of
    # them after it returns, and it is the backend registered under this name, so it gives that
    # name where Dynamo looks (`torch._dynamo.backends.registry._is_registered_backend`): as its
    # `__name__`, which `torch.compile`'s wrapper takes for the backend's name, and as the
    # `compiler_name` of torch's configured backends, for a call of `torch._dynamo.optimize`.

    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        self.__name__ = self.compiler_name = BACKEND_NAME  # [Note: Parameters swapped after a compile]
        setattr(self, SCOPE_ATTR, config.scope)  # read while Dynamo traces: traced/scope.py
        setattr(self, REGIONS_ATTR, config.regions)

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
        if self.config.compiler is not Compiler.AOT_EAGER:
            start_cpu_probe(example_inputs)  # [Note: The CPU probe in the background] in compile/cpu_probe.py
        if self.config.rank_divergent_graphs:
            return self._compile(gm, example_inputs, owners, None)
        # Ask before scheduling: the protocol's states are in fsdp_graph/compile/agreement.py.
        resolved = self.config.resolved_options()
        options = f"{self.config.compiler.value}:{self.config.cache_key((Stage.SCHEDULE,), resolved)}"
        order, program_order = agreement.frame_order(
            gm, example_inputs, owners, options, beside_caches=self.config.compiler is not Compiler.AOT_EAGER)
        backend = FSDPGraphBackend(replace(self.config, rank_divergent_graphs=True)) if program_order else self
        return backend._compile(gm, example_inputs, owners, order)

    def _compile(
        self, gm: GraphModule, example_inputs: list, owners: list, order: Optional[FrameWireOrder]
    ) -> Callable:
        graph_id = _graph_id()
        dump = self._dump()
        hash_checkpoint_policies(gm)  # [Note: A checkpoint policy's cache_hash] in compile/cache_key.py
        logger.debug("fsdp_graph::compile (%s) with %s", graph_id, self.config.compiler.value)
        if dump is not None:
            dump.write_graph(gm, f"{graph_id}.dynamo")
        choice = self._budget_choice_file(gm, example_inputs)
        if choice is not None and os.path.exists(choice):
            logger.info("fsdp_graph::checkpoint_by_policy (%s) auto: over the budget when this graph last compiled "
                        "(%s); compiling with save_matmuls", graph_id, choice)
            return self._with_policy()._compile_regions(gm, example_inputs, owners, order, graph_id, dump)
        try:
            return self._compile_regions(gm, example_inputs, owners, order, graph_id, dump)
        except Exception as error:
            over = checkpoint_to_fit(error)  # [Note: Checkpointing to fit a budget] in passes/checkpoint_policy.py
            if over is None:
                raise
            logger.info("fsdp_graph::checkpoint_by_policy (%s) auto: %s; compiling again with save_matmuls", graph_id, over)
            forget_partitioned_regions()
            compiled = self._with_policy()._compile_regions(gm, example_inputs, owners, order, graph_id, dump)
            _remember_budget_choice(choice, over)
            return compiled

    def _with_policy(self) -> "FSDPGraphBackend":
        """This backend with the checkpoint policy that "auto" chooses over its budget."""
        return FSDPGraphBackend(replace(self.config, activation_checkpointing="save_matmuls"))

    def _budget_choice_file(self, gm: GraphModule, example_inputs: list) -> Optional[str]:
        """Where `activation_checkpointing="auto"` notes that this graph took the policy; None for other settings.

        [Note: The budget's choice beside the compile caches]
        With compile regions, "auto" learns that the step is over its budget only once the step's
        joint graph is traced, and then compiles the graph again with the policy ([Note:
        Checkpointing to fit a budget] in passes/checkpoint_policy.py). A relaunch would trace it
        twice too: the first compile never finished, so the caches hold nothing for it. So the choice
        is kept in a small file beside Inductor's caches, named by what the compiled graphs depend on
        (`beside_caches_file`: our sources, the options, the Dynamo graph and its inputs' shapes), and
        a graph that finds it compiles with the policy at once: from the caches, on a relaunch. Only
        the choice of the policy is kept: a graph within its budget compiles once anyway."""
        if self.config.activation_checkpointing != "auto":
            return None
        resolved = self.config.resolved_options()
        options = f"{self.config.compiler.value}:{self.config.cache_key(tuple(Stage), resolved)}"
        return beside_caches_file("budget_choices", gm, example_inputs, options, agreement.graph_groups(gm))

    def _compile_regions(
        self, gm: GraphModule, example_inputs: list, owners: list, order: Optional[FrameWireOrder],
        graph_id: str, dump: Optional[GraphDump],
    ) -> Callable:
        """`_compile` of a graph, its compile regions inlined where they do not compile."""
        has_regions = any(is_region_call(n) for n in gm.graph.nodes)
        try:
            # [Note: A region's schema once per body] in compile/region_schema.py
            with region_schemas_once() if has_regions else contextlib.nullcontext():
                compiled = self._compile_with(gm, example_inputs, graph_id, dump, order, has_regions)
        except Exception as error:
            if not has_regions or checkpoint_to_fit(error) is not None:
                raise
            # [Note: Regions that do not compile]
            # AOTAutograd refuses some regions Dynamo took: one that changes a buffer or an input
            # in place in training (BatchNorm's running statistics), and torch may refuse others.
            # Inlined, the same code is an ordinary part of the step, as without regions.
            logger.warning(
                "fsdp_graph::regions (%s): the graph's compile regions did not compile (%s: %s); "
                "compiling them inline", graph_id, type(error).__name__, str(error).splitlines()[0] if str(error) else "",
            )
            gm = inline_regions(gm)
            compiled = self._compile_with(gm, example_inputs, graph_id, dump, order, False)
        if dump is None:
            return compiled
        return RecordFallbacks(compiled, owners, dump)

    def _compile_with(
        self, gm: GraphModule, example_inputs: list, graph_id: str, dump: Optional[GraphDump],
        order: Optional[FrameWireOrder], has_regions: bool,
    ) -> Callable:
        """`_compile`'s AOTAutograd and inner compiler: `aot_eager`, or Inductor (in pieces where they apply)."""
        if self.config.compiler is Compiler.AOT_EAGER:
            return self._aot_eager(gm, example_inputs, graph_id, dump, order)
        from torch._inductor.compile_fx import compile_fx

        patches = self.inductor_patches(gm, example_inputs, graph_id, dump, order)
        inner, aot_config = _inner_compile, {}
        if self.config.pieces and _pieces_apply(gm):  # [Note: Pieces between the collectives] in compile/pieces.py
            schedule_pass = patches["post_grad_custom_post_pass"]
            # the passes run in `compile_in_pieces`, their key stays in the caches' keys
            patches["post_grad_custom_post_pass"] = KeyOnly(schedule_pass.uuid())
            schedule_pass.lower = self._pipeline(Stage.LOWER, self.config.resolved_options(), dump, skip={"pin_order"})
            inner = functools.partial(_inner_compile, compile_fx_inner=functools.partial(compile_in_pieces, schedule_pass))
            # [Note: A step of pieces in AOTAutograd's cache]: stored bundled, and the backward
            # compiled with the forward, so that the entry is saved while these settings hold.
            aot_config = {"bundled_autograd_cache": True, "force_non_lazy_backward_lowering": True}
        elif has_regions:  # torch 2.13 reuses a region's buffers wrongly
            patches["allow_buffer_reuse"] = False  # on CPU: examples/repro/nested_region_inductor_grads.py
        with stable_cache_keys(), functorch_config.patch(aot_config):  # see [Note: Rank-independent cache keys]
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)

    def _pipeline(
        self, stage: Stage, resolved: dict[str, Any], dump: Optional[GraphDump], skip: frozenset[str] = frozenset()
    ) -> PassPipeline:
        return PassPipeline(stage.value, self.config.passes(stage, resolved), self.config.disabled_passes | skip, dump)

    def _aot_eager(self, gm, example_inputs, graph_id, dump: Optional[GraphDump], order: Optional[FrameWireOrder]):
        from torch._dynamo.backends.common import aot_autograd

        resolved = self.config.resolved_options()
        joint = self._pipeline(Stage.JOINT, resolved, dump)
        schedule = self._pipeline(Stage.SCHEDULE, resolved, dump)
        lower = self._pipeline(Stage.LOWER, resolved, dump)

        def partition_joint(joint_gm, joint_inputs, **kwargs):
            first_gathers = order.first_backward_gathers() if order is not None else None
            return partition(_run_joint(joint, joint_gm, graph_id, first_gathers), joint_inputs,
                             checkpoint_policy=resolved["activation_checkpointing"], **kwargs)

        def inner(kind: str):
            def compile_graph(graph: GraphModule, _inputs):
                _log_graph(graph_id, kind, graph, dump)
                graph = _schedule(schedule, lower, graph_id, kind, graph, dump, order)
                return _eager_graph(inline_regions(graph), _inputs)

            return compile_graph

        return aot_autograd(
            fw_compiler=inner("forward"),
            bw_compiler=inner("backward"),
            partition_fn=partition_joint,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    def inductor_patches(
        self, gm: GraphModule, example_inputs: list, graph_id: str, dump: Optional[GraphDump],
        order: Optional[FrameWireOrder] = None,
    ) -> dict[str, Any]:
        """The Inductor config this backend compiles `gm` with: our passes as Inductor's custom
        passes, whose `uuid`s (None while dumping: no cache, so that every graph is written) put
        everything they depend on into the FX graph cache's and AOTAutogradCache's keys, the wire
        order a recompiled frame keeps included ([Note: One wire order per frame]), and this rank
        on gloo (`_gloo_rank`)."""
        resolved = self.config.resolved_options()
        joint = self._pipeline(Stage.JOINT, resolved, dump)
        schedule = self._pipeline(Stage.SCHEDULE, resolved, dump)
        lower = self._pipeline(Stage.LOWER, resolved, dump)
        digest = own_sources_digest()[:16]
        # The local shard shapes, in the joint pass's key: see [Note: Rank-independent cache keys].
        joint_key = f"fsdp_graph.joint:{digest}:{self.config.cache_key((Stage.JOINT,), resolved)}:{local_shapes(example_inputs)}"
        schedule_key = f"fsdp_graph.schedule:{digest}:{self.config.cache_key((Stage.SCHEDULE, Stage.LOWER), resolved)}"
        if order is not None and order.cache_key():
            schedule_key += f":{hashlib.sha256(order.cache_key().encode()).hexdigest()[:16]}"
        if "reduce_scatters_in_place_on_gloo" not in self.config.disabled_passes:
            schedule_key += _gloo_rank(example_inputs)
        first_gathers = order.first_backward_gathers() if order is not None else None
        if first_gathers is not None:
            joint_key += f":{hashlib.sha256(repr(sorted(first_gathers)).encode()).hexdigest()[:16]}"
        patches: dict[str, Any] = {
            "joint_custom_pre_pass": _InductorJointPass(
                joint, graph_id, None if dump is not None else joint_key, first_gathers
            ),
            "custom_partitioner_fn": InductorPartitioner(resolved["activation_checkpointing"]),
            "post_grad_custom_post_pass": _InductorSchedulePass(
                graph_id, dump, schedule, lower, None if dump is not None else schedule_key, order
            ),
        }
        disabled = self.config.disabled_passes
        if "async_tp" not in disabled:
            patches.update(async_tp_on_cuda(example_inputs))
        if "pin_order" not in disabled:
            # [Note: Inductor keeps the planned order]
            # Our passes place every collective and wait within a memory budget that the simulator
            # checks in graph order, and pin_order makes the collectives' places binding. Inductor's
            # own `reorder_for_peak_memory` still moved the compute between them: it postponed
            # gradient matmuls whose outputs live to the end, and with them the all-gather and
            # reduce-scatter pinned next to them, so the gradient buckets of two blocks were alive
            # at once, over the budget. Its model knows neither gloo's copies nor our budget; ours
            # does, so it decides (docs/compiler.md, "What a memory budget counts", has the figures).
            patches["reorder_for_peak_memory"] = False
            # Inductor's buffer reuse keeps a freed buffer alive until a later buffer of the same
            # size takes it over: a block's packed gradients held from its reduce-scatter's wait
            # until the next all-gather's output, gathered blocks held between their all-gathers,
            # over the budget. The budget is planned on freeing at last use.
            patches["allow_buffer_reuse"] = False
        return patches


def _pieces_apply(gm: GraphModule) -> bool:
    """Whether `pieces=True` compiles this graph in pieces: not under CUDA graphs (pieces compile
    without them); such a graph compiles as one, and the log says so. A graph with compile regions
    is compiled in pieces with its regions inlined (`compile_in_pieces`)."""
    from torch._inductor import config as inductor_config

    if inductor_config.triton.cudagraphs:
        logger.info("fsdp_graph: pieces=True, but the graph compiles whole: CUDA graphs are on")
        return False
    return True


def _gloo_rank(example_inputs: list) -> str:
    """This rank, for the schedule pass's key, where the graph's groups run on gloo: there a
    backward reads this rank's row of each reduce-scatter ([Note: Reduce-scatters on gloo] in
    passes/gloo.py), so it is this rank's own and no other rank may load it from the caches
    ([Note: Rank-independent cache keys])."""
    groups = {o.mesh_info.shard_group for o in owners_of(example_inputs)}
    if any("gloo" in str(torch.distributed.get_backend(group)) for group in groups):
        return f":rank{torch.distributed.get_rank()}"
    return ""


def _inner_compile(*args, compile_fx_inner: Optional[Callable] = None, **kwargs):
    """Inductor's `compile_fx_inner` (or the given inner compiler) with rank-independent cache keys:
    AOTAutograd lowers the backward lazily, at the first backward, after `compile_fx` has returned,
    so the context around that call does not cover it ([Note: Rank-independent cache keys])."""
    if compile_fx_inner is None:
        from torch._inductor.compile_fx import compile_fx_inner

    wait_for_cpu_probe()  # [Note: The CPU probe in the background] in compile/cpu_probe.py
    with stable_cache_keys():
        return compile_fx_inner(*args, **kwargs)


def _run_joint(
    joint: PassPipeline, gm: GraphModule, graph_id: str, first_gathers: Optional[frozenset[str]]
) -> GraphModule:
    """The joint passes on `gm`; for a later graph of a frame, told which groups the frame's first
    backward gathers ([Note: One collective set per frame] in passes/unshard_selection.py)."""
    if first_gathers is not None:
        gm.meta[FIRST_BACKWARD_GATHERS_META] = first_gathers
    return joint(gm, graph_id)


def _log_graph(graph_id: str, kind: str, gm: GraphModule, dump: Optional[GraphDump]) -> None:
    logger.debug("fsdp_graph::graph (%s.%s) %s", graph_id, kind, count_ops(gm))
    if dump is not None:
        dump.write_graph(gm, f"{graph_id}.{kind}")
        dump.record_graph(graph_id, kind, gm)


class _InductorJointPass(CustomGraphPass):
    """Runs the joint pipeline inside Inductor. `uuid`: what the pipeline's result depends on
    (`FSDPGraphBackend.inductor_patches`); None disables the caches."""

    def __init__(
        self, pipeline: PassPipeline, graph_id: str, key: Optional[str], first_gathers: Optional[frozenset[str]]
    ) -> None:
        self.pipeline = pipeline
        self.graph_id = graph_id
        self.key = key
        self.first_gathers = first_gathers

    def __call__(self, graph: torch.fx.Graph) -> None:
        _run_joint(self.pipeline, graph.owning_module, self.graph_id, self.first_gathers)

    def uuid(self) -> Optional[str]:
        return self.key


class _InductorSchedulePass(CustomGraphPass):
    """Schedules the forward and the backward graph inside Inductor, as it is about to lower them:
    dumps the graph when dumping, runs the scheduling passes, writes the program for the inspector,
    then runs the lowering passes. `uuid` as `_InductorJointPass`'s."""

    def __init__(
        self, graph_id: str, dump: Optional[GraphDump], schedule: PassPipeline, lower: PassPipeline, key: Optional[str],
        order: Optional[FrameWireOrder] = None,
    ) -> None:
        self.order = order
        self.graph_id = graph_id
        self.dump = dump
        self.schedule = schedule
        self.lower = lower
        self.key = key

    def __call__(self, graph: torch.fx.Graph) -> None:
        kind = "backward" if is_backward_graph(graph) else "forward"
        if self.dump is not None:
            _log_graph(self.graph_id, kind, graph.owning_module, self.dump)
        _schedule(self.schedule, self.lower, self.graph_id, kind, graph.owning_module, self.dump, self.order)

    def uuid(self) -> Optional[str]:
        return self.key


def _eager_graph(graph: GraphModule, example_inputs: list) -> Callable:
    """`graph` run op by op, as torch's aot_eager runs one: under `aot_compile`
    (fsdp_graph.precompile) an OutputCode that AOTAutograd's bundled entry saves, else a boxed
    function ([Note: Saving an aot_eager step])."""
    compiled = boxed_nop(graph, example_inputs)
    if not isinstance(compiled, AOTEagerOutputCode):
        return compiled
    savable = _SavableEagerGraph(gm=compiled.gm)
    savable._boxed_call = True
    return savable


# [Note: Saving an aot_eager step]
# torch's aot_eager saves a step's forward and backward as `AOTEagerOutputCode`, whose graph
# `GraphPickler` writes with each node's fake value. A value our passes computed as a view of
# another (a bucket's slices) holds its base, and GraphPickler writes the base's fake mode too,
# which it cannot ("Cannot access data pointer of Tensor"). Nothing runs on those values once the
# graph is compiled, so they are left out of the saved graph.
class _SavableEagerGraph(AOTEagerOutputCode):
    def prepare_for_serialization(self) -> None:
        for node in self.gm.graph.nodes:
            values = pytree.tree_leaves(node.meta.get("val"))
            if any(isinstance(value, torch.Tensor) and value._base is not None for value in values):
                del node.meta["val"]
        super().prepare_for_serialization()


def _schedule(
    schedule: PassPipeline, lower: PassPipeline, graph_id: str, kind: str, gm: GraphModule, dump: Optional[GraphDump],
    order: Optional[FrameWireOrder] = None,
) -> GraphModule:
    """Run the scheduling passes on a forward or backward graph, keep the frame's wire order
    ([Note: One wire order per frame]), then run the lowering passes; between the two, when
    dumping, write its program for `python -m fsdp_graph.inspect` (see
    fsdp_graph/inspect/timeline.py). The lowering passes' control dependencies (pin_order) would
    hide collectives and waits from the program, and they change no order."""
    from ..inspect.timeline import write_program

    gm = schedule(gm, f"{graph_id}.{kind}")
    if order is not None:
        order.keep(kind, gm)
    if dump is not None and dump.directory is not None:
        write_program(dump.directory, f"{graph_id}.{kind}", gm)
    return lower(gm, f"{graph_id}.{kind}")


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
setattr(fsdp_graph_backend, REGIONS_ATTR, BackendConfig.regions)


def _register() -> None:
    # Installed packages register through the `torch_dynamo_backends` entry point, which Dynamo
    # loads (and registers) on first lookup; registering here too would be a duplicate. A source
    # checkout on sys.path has no entry point, so it registers on import.
    if not entry_points(group="torch_dynamo_backends", name=BACKEND_NAME):
        torch._dynamo.register_backend(fsdp_graph_backend, name=BACKEND_NAME)


_register()
