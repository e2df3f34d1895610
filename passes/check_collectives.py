"""A debug pass: check at run time that no buffer of an in-flight collective is touched before its wait.

    FSDP_GRAPH_CHECK_COLLECTIVES=1 python train.py      # or fsdp_graph.backend(check_collectives=True)

[Note: Checking in-flight collectives]
Between a collective's issue and its `wait_tensor`, the backend (gloo's worker threads, NCCL's
stream) reads the input and writes the output asynchronously. Nothing else may write the input, or
free, resize or reuse either buffer, until the wait: on gloo such a bug can corrupt the heap, on
NCCL it silently corrupts numbers. This pass makes every collective of a forward or backward graph
check that at run time:

    out      = collective(x, ...)
    snapshot, layout = fsdp_graph::collective_issued(x, out)   # x's bytes; x's and out's storages
    ...
    fsdp_graph::check_collective(snapshot, layout, x, out, "name (group)")  # raises if changed
    w        = wait_tensor(out)

`check_collective` raises `CollectiveBufferError`, naming the collective, if x's bytes differ
from the snapshot, or if x's or out's storage moved, shrank or was freed (`resize_(0)`). The
check reads `out` before its wait, so Inductor orders it before the wait (it models the wait as
a mutation of `out`), and it reads `x`, which Inductor keeps alive until the wait anyway. It costs
a copy of every collective input, so it is for debugging and tests, off by default.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule

from .nodes import collective_label, collective_of, is_collective, is_wait_tensor

# Read when a compile's `check_collectives` option is None; "1" turns the checks on.
CHECK_COLLECTIVES_ENV = "FSDP_GRAPH_CHECK_COLLECTIVES"


class CollectiveBufferError(RuntimeError):
    """A buffer of an in-flight collective was written, freed or resized before its wait."""


def _storage_facts(t: torch.Tensor) -> list[int]:
    storage = t.untyped_storage()
    return [storage.data_ptr(), storage.nbytes()]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


@torch.library.custom_op("fsdp_graph::collective_issued", mutates_args=())
def collective_issued(input: torch.Tensor, output: torch.Tensor) -> list[torch.Tensor]:
    """(a copy of `input`'s bytes, [input data_ptr, input nbytes, output data_ptr, output nbytes])."""
    layout = torch.tensor(_storage_facts(input) + _storage_facts(output), dtype=torch.int64)
    return [_bytes_of(input).clone(), layout]


@collective_issued.register_fake
def _(input, output):
    return [input.new_empty(input.numel() * input.element_size(), dtype=torch.uint8), torch.empty(4, dtype=torch.int64)]


# `snapshot` is declared mutated (it is not): a custom op without outputs or mutations is dead code
# to FX and Inductor and would be removed.
@torch.library.custom_op("fsdp_graph::check_collective", mutates_args=("snapshot",))
def check_collective(
    snapshot: torch.Tensor, layout: torch.Tensor, input: torch.Tensor, output: torch.Tensor, label: str
) -> None:
    """Raise `CollectiveBufferError` if `input` or `output` changed since `collective_issued`."""
    in_ptr, in_nbytes, out_ptr, out_nbytes = layout.tolist()
    problems = []
    for what, t, ptr, nbytes in (("input", input, in_ptr, in_nbytes), ("output", output, out_ptr, out_nbytes)):
        now_ptr, now_nbytes = _storage_facts(t)
        if now_nbytes != nbytes:
            problems.append(f"its {what}'s storage was resized from {nbytes} to {now_nbytes} bytes (freed if 0)")
        elif now_ptr != ptr:
            problems.append(f"its {what}'s storage moved from {ptr:#x} to {now_ptr:#x}")
    # An in-place collective (`all_reduce_`, [Note: Reduce-scatters on gloo]) writes its input itself.
    if not problems and in_ptr != out_ptr:
        now = _bytes_of(input)
        if not torch.equal(now, snapshot):
            num_changed = int((now != snapshot).sum())
            problems.append(f"{num_changed} of its input's {now.numel()} bytes were overwritten")
    if problems:
        if output.untyped_storage().nbytes() == out_nbytes:
            torch.ops._c10d_functional.wait_tensor(output)  # leave no work behind in the registry
        raise CollectiveBufferError(
            f"fsdp_graph::check_collectives: collective {label} was in flight when "
            + "; ".join(problems)
            + ". A buffer of a collective must stay untouched between the collective and its wait_tensor; "
            "see [Note: Checking in-flight collectives] in passes/check_collectives.py"
        )


@check_collective.register_fake
def _(snapshot, layout, input, output, label):
    return None


def check_collectives(gm: GraphModule) -> GraphModule:
    """Insert the checks of [Note: Checking in-flight collectives] around every waited collective.

    Assumes: the graph's final order (run after the scheduling passes). Guarantees: the same
    values; each collective is followed by its snapshot and its first wait is preceded by its
    check, which raises `CollectiveBufferError` if a buffer of the collective changed.
    """
    waits = [n for n in gm.graph.nodes if is_wait_tensor(n) and collective_of(n) is not None]
    seen = set()
    for wait in waits:
        collective = collective_of(wait)
        if collective in seen or not is_collective(collective):
            continue
        seen.add(collective)
        source = collective.args[0]
        if not isinstance(source, torch.fx.Node):
            continue
        with gm.graph.inserting_after(collective):
            issued = gm.graph.call_function(torch.ops.fsdp_graph.collective_issued.default, (source, collective))
        with gm.graph.inserting_after(issued):
            snapshot = gm.graph.call_function(operator.getitem, (issued, 0))
        with gm.graph.inserting_after(snapshot):
            layout = gm.graph.call_function(operator.getitem, (issued, 1))
        _set_fake_values(source, issued, snapshot, layout)
        with gm.graph.inserting_before(wait):
            label = f"{collective.name} ({collective_label(collective)})"
            check = gm.graph.call_function(
                torch.ops.fsdp_graph.check_collective.default, (snapshot, layout, source, collective, label)
            )
        check.meta["val"] = None
    return gm


def _set_fake_values(source, issued, snapshot, layout) -> None:
    """The `val` metadata later passes and Inductor read, from the fake implementation."""
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return
    fake_mode = torch._guards.detect_fake_mode([val])
    with fake_mode if fake_mode is not None else torch._subclasses.FakeTensorMode():
        values = torch.ops.fsdp_graph.collective_issued.default(val, val)
    issued.meta["val"] = values
    snapshot.meta["val"], layout.meta["val"] = values
