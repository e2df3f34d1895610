"""The scheduling passes of the forward and backward graphs, in order, with their options bound.

    merge_tp_all_reduces tensor parallelism's all-reduces that autograd adds up, as one all-reduce
                         of the sum (passes/async_tp.py)
    async_tp             tensor parallelism's matmul -> all-reduce split into chunks that overlap
                         (passes/async_tp.py)
    bucket_by_group      one bucket per fully_shard group (the eager runtime's plan)
    auto_bucket          merge latency-bound buckets, split ones over the cap
    reorder_for_overlap  prefetch all-gathers, issue reduce-scatters early and wait late
    overlap_tp_all_reduces  computation a tp all-reduce does not need moved below it, to run under it
                         (passes/tp_overlap.py)
    pin_order            (Inductor only, `PIN_ORDER`, run after the others and after the program
                         for the inspector is written) control dependencies so Inductor keeps that order

Each can be switched off by name (`BackendConfig.disabled_passes`).
"""

from __future__ import annotations

import functools
from typing import Optional

from .async_tp import DEFAULT_NUM_CHUNKS, decompose_tp_matmuls, merge_summed_all_reduces
from .bucketing import auto_bucket, bucket_by_group
from .cost_model import CostModel
from .pipeline import GraphPass
from .reorder import pin_order, reorder_for_overlap
from .tp_overlap import overlap_tp_all_reduces

SCHEDULING_PASS_NAMES = ("merge_tp_all_reduces", "async_tp", "bucket_by_group", "auto_bucket", "reorder_for_overlap", "overlap_tp_all_reduces", "pin_order")
# The passes that merge or reorder collectives of different groups: a rank that runs one of those
# groups on the eager hooks would put other collectives on the wire (backend `rank_divergent_graphs`).
CROSS_GROUP_PASS_NAMES = ("auto_bucket", "reorder_for_overlap")
PIN_ORDER = GraphPass("pin_order", pin_order)


def scheduling_passes(
    cost_model: CostModel,
    bucket_cap_bytes: int,
    max_bytes_in_flight: Optional[int],
    memory_budget_bytes: Optional[int],
    max_collectives_in_flight: Optional[int] = None,
    async_tp_chunks: int = DEFAULT_NUM_CHUNKS,
) -> list[GraphPass]:
    """The passes that decide the order; `PIN_ORDER` makes it binding for Inductor."""
    return [
        GraphPass("merge_tp_all_reduces", merge_summed_all_reduces),
        GraphPass("async_tp", functools.partial(decompose_tp_matmuls, num_chunks=async_tp_chunks)),
        GraphPass("bucket_by_group", bucket_by_group),
        GraphPass("auto_bucket", functools.partial(auto_bucket, cost_model=cost_model, bucket_cap_bytes=bucket_cap_bytes)),
        GraphPass(
            "reorder_for_overlap",
            functools.partial(
                reorder_for_overlap,
                cost_model=cost_model,
                max_bytes_in_flight=max_bytes_in_flight,
                memory_budget_bytes=memory_budget_bytes,
                max_collectives_in_flight=max_collectives_in_flight,
            ),
        ),
        GraphPass("overlap_tp_all_reduces", functools.partial(overlap_tp_all_reduces, cost_model=cost_model)),
    ]
