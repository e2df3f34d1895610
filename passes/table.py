"""The table of graph passes: every pass the backend runs, in order, with where it runs, the options
it reads and whether it merges or reorders the collectives of several groups.

Everything that lists passes or their options is derived from `PASSES`: the backend's options and
their checks (`BackendConfig`), both compile-cache keys (`cache_key`), `disabled_passes`, the
pipelines of the backend and of `fsdp_graph.predict` (`bound_passes`), the inspector's pass times
and `python -m fsdp_graph.inspect --passes`, which prints the list in docs/compiler.md.

Adding a pass: write it in a file of its own (`def my_pass(gm: GraphModule, my_option: int) ->
GraphModule`), and add one `PassSpec` here, with an `Option` if it takes one. docs/compiler.md
("Adding a pass") walks through an example.
"""

from __future__ import annotations

import functools
import os
import textwrap
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Mapping, Optional

import torch
from torch.fx import GraphModule

from .async_tp import DEFAULT_NUM_CHUNKS, decompose_tp_matmuls, merge_summed_all_reduces
from .bucketing import auto_bucket, bucket_by_group
from .check_collectives import CHECK_COLLECTIVES_ENV, check_collectives
from .checkpoint_policy import POLICIES, checkpoint_by_policy
from .cost_model import CostModel, HardwareProfile, Profile
from .ep_overlap import overlap_all_to_alls
from .gloo import plain_all_gathers_on_gloo, reduce_scatters_in_place_on_gloo
from .pipeline import GraphPass
from .pin_order import pin_order
from .reorder import reorder_for_overlap
from .reshard import tag_reshard_after_forward
from .tp_overlap import overlap_tp_all_reduces
from .unshard_selection import select_unsharded


class Stage(Enum):
    """Where a pass runs, in the order a compile reaches the stages."""

    JOINT = "joint"  # the joint forward-backward graph, before the min-cut partitioner splits it
    SCHEDULE = "schedule"  # the forward and the backward graph; the inspector's program is their result
    LOWER = "lower"  # the forward and the backward graph after the program is written, before the compiler


@dataclass(frozen=True)
class Option:
    """A backend option that passes read: a field of `BackendConfig` and a `torch.compile(...,
    options={...})` key of the same name.

    Attributes:
        name: the option's name.
        default: its value when not given.
        check: what is wrong with a value, as the end of "<name> ...", e.g. "must be a positive
            int"; None when the value is fine.
        doc: what it does, for `BackendConfig`'s docstring and the docs.
        example: a valid value other than the default (for the docs, and for the test that every
            option reaches the compile-cache keys).
        keyword: the keyword the passes take it as; None: `name`.
        resolve: the value the passes get, from the option's (e.g. a profile name to a `CostModel`).
        cache_repr: the resolved value as the compile-cache keys spell it.
    """

    name: str
    default: Any
    check: Callable[[Any], Optional[str]]
    doc: str
    example: Any
    keyword: Optional[str] = None
    resolve: Callable[[Any], Any] = lambda value: value
    cache_repr: Callable[[Any], str] = repr

    def problem(self, value: Any) -> Optional[str]:
        """The sentence that says what is wrong with `value`, or None."""
        wrong = self.check(value)
        return None if wrong is None else f"{self.name} {wrong}, got {value!r}"


@dataclass(frozen=True)
class PassSpec:
    """One row of the table.

    Attributes:
        name: how logs, dumps, the inspector and `disabled_passes` name the pass.
        fn: the pass, `fn(gm, **options) -> gm`; its options are bound by keyword.
        stage: where it runs.
        summary: what it does, one sentence, for the docs' list.
        options: the options it reads.
        differs_from_eager: it makes the graph's collectives differ from those the eager hooks
            issue: it merges or reorders the collectives of several groups, or leaves a group's
            re-gather out. A rank that runs one of those groups on the eager hooks would put other
            collectives on the wire, so such passes are left out where ranks may compile different
            graphs (`BackendConfig.rank_divergent_graphs`).
        inductor_only: it runs only when Inductor compiles the graphs (`aot_eager` runs them op
            for op as traced).
        enabled_by: an option whose resolved value turns the pass on; None: always on (unless
            disabled by name).
    """

    name: str
    fn: Callable[..., GraphModule]
    stage: Stage
    summary: str
    options: tuple[Option, ...] = ()
    differs_from_eager: bool = False
    inductor_only: bool = False
    enabled_by: Optional[Option] = None

    def reads(self) -> tuple[Option, ...]:
        """Every option that decides what the pass does, `enabled_by` included."""
        return self.options + ((self.enabled_by,) if self.enabled_by is not None else ())


# -- options -------------------------------------------------------------------------------------------


def _int_at_least(minimum: int, *, or_none: bool, note: str = "") -> Callable[[Any], Optional[str]]:
    kind = "positive" if minimum == 1 else "non-negative"
    wanted = f"must be a {kind} int{' or None' if or_none else ''}{note}"

    def check(value: Any) -> Optional[str]:
        if value is None and or_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            return wanted
        return None

    return check


def _cost_model(profile: Any) -> CostModel:
    if isinstance(profile, CostModel):
        return profile
    if profile is None:
        profile = Profile.H100_NVLINK if torch.cuda.is_available() else Profile.CPU_GLOO
    return CostModel(profile)


def _check_profile(value: Any) -> Optional[str]:
    if value is None or isinstance(value, (CostModel, HardwareProfile, Profile)):
        return None
    names = [p.value.name for p in Profile]
    if value not in names:
        return f"must be None, one of {names}, a HardwareProfile or a CostModel"
    return None


def _cost_model_repr(cost_model: CostModel) -> str:
    return repr((cost_model.profile, sorted(cost_model.links.items())))


def _check_policy(value: Any) -> Optional[str]:
    return None if value is None or value in POLICIES else f"must be None or one of {list(POLICIES)}"


def _check_tri_state(value: Any) -> Optional[str]:
    return None if value in (None, True, False) else "must be True, False or None"


def _checking_collectives(value: Optional[bool]) -> bool:
    if value is not None:
        return value
    return os.environ.get(CHECK_COLLECTIVES_ENV) == "1"


HARDWARE_PROFILE = Option(
    "hardware_profile", None, _check_profile,
    'the cost model\'s machine: a name ("h100-nvlink", "h100-infiniband", "cpu-gloo"), a `HardwareProfile` '
    "(e.g. from `passes.cost_model.calibrate`) or a `CostModel` (which may give another parallelism its own "
    'link). None: "h100-nvlink" when CUDA is available, else "cpu-gloo".',
    example="h100-infiniband", keyword="cost_model", resolve=_cost_model, cache_repr=_cost_model_repr,
)
BUCKET_CAP_BYTES = Option(
    "bucket_cap_bytes", 1 << 30, _int_at_least(1, or_none=False),
    "auto-bucketing merges latency-bound buckets up to this size and splits larger buckets.",
    example=1 << 20,
)
MAX_BYTES_IN_FLIGHT = Option(
    "max_bytes_in_flight", None, _int_at_least(0, or_none=True),
    "the most collective bytes issued and not yet waited on; None: no limit.",
    example=1 << 20,
)
MAX_COLLECTIVES_IN_FLIGHT = Option(
    "max_collectives_in_flight", None, _int_at_least(1, or_none=True),
    "the most collectives issued and not yet waited on; None: no limit (gloo included: its all-gathers "
    "go through gloo's plain allgather, see [Note: All-gathers on gloo] in passes/gloo.py).",
    example=1,
)
MEMORY_BUDGET_BYTES = Option(
    "memory_budget_bytes", None, _int_at_least(0, or_none=True),
    "the predicted peak memory a step may hold above its start, when reordering: what a graph allocates, "
    "and in a backward also the activations its forward saved (parameters, optimizer state and the batch "
    "are not counted); prefetch gets shallower to stay within it. None: the unscheduled peak plus two of "
    "the largest buckets. Given explicitly, it is also the budget for keeping groups unsharded from "
    'forward to backward ("unshard_selection", passes/unshard_selection.py): it then overrides '
    "`reshard_after_forward=True`; the groups are chosen at the sizes of a frame's first graph and kept "
    "by its later graphs, so that every rank gathers the same ones.",
    example=1 << 30,
)
ASYNC_TP_CHUNKS = Option(
    "async_tp_chunks", DEFAULT_NUM_CHUNKS, _int_at_least(1, or_none=False, note=" (1: no chunks)"),
    "the row chunks each tensor-parallel matmul -> all-reduce is split into, so that each chunk's "
    'all-reduce runs behind the next chunk\'s matmul ("async_tp", passes/async_tp.py); 1 leaves them '
    'whole, as does disabling "async_tp".',
    example=2, keyword="num_chunks",
)
ACTIVATION_CHECKPOINTING = Option(
    "activation_checkpointing", None, _check_policy,
    'the step\'s activations chosen on the graph: "save_matmuls" saves each `fully_shard` group\'s matmul and '
    "attention outputs from forward to backward and recomputes the rest there (torchtitan graph_trainer's default "
    'policy; "checkpoint_by_policy", passes/checkpoint_policy.py). "auto": the same only where the step\'s '
    "predicted peak with every activation kept is over `memory_budget_bytes`, which it requires (then groups are "
    "kept unsharded with what the policy freed). None: the partitioner\'s choice, and the model's own "
    "checkpointing, as without the backend.",
    example="save_matmuls", keyword="policy",
)
CHECK_COLLECTIVES = Option(
    "check_collectives", None, _check_tri_state,
    "check at run time that no buffer of an in-flight collective is written, freed or resized before its "
    "wait, and raise `CollectiveBufferError` naming it if so ([Note: Checking in-flight collectives] in "
    "passes/check_collectives.py); a copy of every collective input per step, for debugging. None: on "
    f"when the `{CHECK_COLLECTIVES_ENV}` environment variable is \"1\".",
    example=True, resolve=_checking_collectives,
)


# -- the table -----------------------------------------------------------------------------------------

PASSES: tuple[PassSpec, ...] = (
    PassSpec(
        "checkpoint_by_policy", checkpoint_by_policy, Stage.JOINT,
        "with `activation_checkpointing`, tags each group's forward for the partitioner: matmul and attention "
        'outputs saved, the rest recomputed in backward; "auto": only where the step\'s predicted peak is over '
        "`memory_budget_bytes` (passes/checkpoint_policy.py)",
        options=(ACTIVATION_CHECKPOINTING, MEMORY_BUDGET_BYTES), enabled_by=ACTIVATION_CHECKPOINTING,
    ),
    PassSpec(
        "unshard_selection", select_unsharded, Stage.JOINT,
        "under an explicit `memory_budget_bytes`, keeps the groups that fit unsharded from forward to backward, "
        "last block first (passes/unshard_selection.py)",
        options=(MEMORY_BUDGET_BYTES,), differs_from_eager=True,
    ),
    PassSpec(
        "reshard_after_forward", tag_reshard_after_forward, Stage.JOINT,
        "tags each resharding group's forward all-gather for recomputation, so the backward gathers again "
        "(passes/reshard.py)",
    ),
    PassSpec(
        "merge_tp_all_reduces", merge_summed_all_reduces, Stage.SCHEDULE,
        "tensor parallelism's all-reduces that autograd adds up become one all-reduce of the sum "
        "(passes/async_tp.py)",
    ),
    PassSpec(
        "async_tp", decompose_tp_matmuls, Stage.SCHEDULE,
        "each tensor-parallel matmul -> all-reduce split into `async_tp_chunks` row chunks, chunk c's "
        "all-reduce behind chunk c+1's matmul (passes/async_tp.py)",
        options=(ASYNC_TP_CHUNKS,),
    ),
    PassSpec(
        "bucket_by_group", bucket_by_group, Stage.SCHEDULE,
        "one all-gather and one reduce-scatter per `fully_shard` group: the eager runtime's buckets "
        "(passes/bucketing.py)",
    ),
    PassSpec(
        "auto_bucket", auto_bucket, Stage.SCHEDULE,
        "merges adjacent buckets the cost model calls latency-bound, up to `bucket_cap_bytes`, and splits "
        "larger ones, bitwise the same values (passes/bucketing.py)",
        options=(HARDWARE_PROFILE, BUCKET_CAP_BYTES), differs_from_eager=True,
    ),
    PassSpec(
        "reorder_for_overlap", reorder_for_overlap, Stage.SCHEDULE,
        "prefetches all-gathers (AG(i+1) before compute(i)), issues reduce-scatters early and waits on them "
        "late, within the memory budget and the in-flight limits (passes/reorder.py)",
        options=(HARDWARE_PROFILE, MAX_BYTES_IN_FLIGHT, MEMORY_BUDGET_BYTES, MAX_COLLECTIVES_IN_FLIGHT),
        differs_from_eager=True,
    ),
    PassSpec(
        "overlap_tp_all_reduces", overlap_tp_all_reduces, Stage.SCHEDULE,
        "computation a tensor-parallel all-reduce does not need moves below it, to run under it "
        "(passes/tp_overlap.py)",
        options=(HARDWARE_PROFILE,),
    ),
    PassSpec(
        "overlap_all_to_alls", overlap_all_to_alls, Stage.SCHEDULE,
        "work that does not read an all-to-all's tokens (expert parallelism's dispatch and combine; a shared "
        "expert) moves up between it and its wait, to run while they travel; the slices of a `run_in_chunks` "
        "layer send their tokens in pairs (passes/ep_overlap.py)",
        options=(HARDWARE_PROFILE,),
    ),
    PassSpec(
        "plain_all_gathers_on_gloo", plain_all_gathers_on_gloo, Stage.SCHEDULE,
        "on gloo, every all-gather through gloo's plain allgather, which torch 2.13 runs safely with several "
        "in flight ([Note: All-gathers on gloo] in passes/gloo.py); switch it off only to reproduce that fault",
    ),
    PassSpec(
        "reduce_scatters_in_place_on_gloo", reduce_scatters_in_place_on_gloo, Stage.LOWER,
        "on gloo, a reduce-scatter of a bucket made for it becomes an in-place all-reduce of that bucket and "
        "a view of this rank's row: the same sums, without gloo's copies ([Note: Reduce-scatters on gloo])",
        inductor_only=True,
    ),
    PassSpec(
        "check_collectives", check_collectives, Stage.LOWER,
        "with `check_collectives`, checks at run time that no buffer of an in-flight collective changes "
        "before its wait (passes/check_collectives.py)",
        enabled_by=CHECK_COLLECTIVES,
    ),
    PassSpec(
        "pin_order", pin_order, Stage.LOWER,
        "`control_deps` edges so that Inductor's scheduler keeps the planned order of collectives, waits and "
        "compute (passes/pin_order.py)",
        inductor_only=True,
    ),
)

PASS_NAMES: tuple[str, ...] = tuple(spec.name for spec in PASSES)
# Every option some pass reads, once each, in the order the table first names them.
OPTIONS: tuple[Option, ...] = tuple({o.name: o for spec in PASSES for o in spec.reads()}.values())


def option_problems(values: Mapping[str, Any]) -> list[str]:
    """What is wrong with the options' `values` (by name), one sentence each."""
    return [p for p in (o.problem(values[o.name]) for o in OPTIONS) if p is not None]


def resolve(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values the passes get, by option name (e.g. "hardware_profile" -> a `CostModel`)."""
    return {o.name: o.resolve(values[o.name]) for o in OPTIONS}


def specs(stage: Stage, resolved: Mapping[str, Any], *, inductor: bool, rank_divergent_graphs: bool = False) -> list[PassSpec]:
    """The rows that run at `stage` for this compile, in order (before `disabled_passes`)."""
    found = []
    for spec in PASSES:
        if spec.stage is not stage or (spec.inductor_only and not inductor):
            continue
        if spec.differs_from_eager and rank_divergent_graphs:
            continue
        if spec.enabled_by is not None and not resolved[spec.enabled_by.name]:
            continue
        found.append(spec)
    return found


def bind(spec: PassSpec, resolved: Mapping[str, Any]) -> GraphPass:
    """`spec`'s pass with its options bound: `(gm) -> gm`."""
    kwargs = {o.keyword or o.name: resolved[o.name] for o in spec.options}
    return GraphPass(spec.name, functools.partial(spec.fn, **kwargs) if kwargs else spec.fn)


def bound_passes(stage: Stage, resolved: Mapping[str, Any], *, inductor: bool, rank_divergent_graphs: bool = False) -> list[GraphPass]:
    """The passes of `stage` for this compile, in order, options bound."""
    chosen = specs(stage, resolved, inductor=inductor, rank_divergent_graphs=rank_divergent_graphs)
    return [bind(spec, resolved) for spec in chosen]


def cache_key(chosen: list[PassSpec], disabled: frozenset[str], resolved: Mapping[str, Any]) -> str:
    """What the compiled graph depends on in these passes, besides their sources: which of them run,
    and every option any of them reads. Part of the passes' `uuid`, so of Inductor's FX graph cache
    key and of AOTAutogradCache's key."""
    running = [s.name for s in chosen if s.name not in disabled]
    read = {o.name: o for s in chosen for o in s.reads()}
    values = ",".join(f"{name}={o.cache_repr(resolved[name])}" for name, o in read.items())
    return f"{','.join(running)}:{values}"


def format_table() -> str:
    """The table as markdown (docs/compiler.md holds this; `python -m fsdp_graph.inspect --passes`
    prints it)."""
    lines = ["| pass | runs on | options | differs from eager | what it does |", "|---|---|---|---|---|"]
    for spec in PASSES:
        where = {Stage.JOINT: "joint graph", Stage.SCHEDULE: "forward, backward",
                 Stage.LOWER: "forward, backward, after the inspector's copy"}[spec.stage]
        if spec.inductor_only:
            where += " (Inductor)"
        options = ", ".join(f"`{o.name}`" for o in spec.reads()) or "-"
        lines.append(f"| `{spec.name}` | {where} | {options} | {'yes' if spec.differs_from_eager else 'no'} | {spec.summary} |")
    return "\n".join(lines) + "\n"


def format_options(indent: int, width: int = 104) -> str:
    """The options as `Attributes:` lines of a docstring, each wrapped to `width`."""
    pad = " " * indent
    return "".join(
        textwrap.fill(f"{o.name}: {o.doc}", width, initial_indent=pad, subsequent_indent=pad + "    ",
                      break_on_hyphens=False) + "\n"
        for o in OPTIONS
    )
