"""A rank that raises, exits or stops mid-step makes the other ranks fail quickly, never hang.

Gloo ranks (from _harness's fork server) whose process group has a short timeout (`init_process_group(...,
timeout=timedelta(seconds=PG_TIMEOUT_S))`, the knob fsdp_graph's collectives obey). Rank 1 fails
between forward and backward of step 2; the others are then inside a collective. A rank that dies
closes its connections, so the others fail at once; a rank that is alive but stopped (stuck, or
busy in an exception handler) makes them fail when the timeout expires.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fsdp_graph
from _harness import HangWatch, rank_context
from _models import MLPStack, shard_blocks_then_root

PG_TIMEOUT_S = 5
DEADLINE_S = 60  # ranks that use no CPU this long are hung: killed, and the test fails (see HangWatch)


def _rank_main(fn, rank, world_size, store_path, results, args) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        out = fn(rank, world_size, *args)
        results.put((rank, None, out))
    except BaseException:
        out = None
        results.put((rank, traceback.format_exc(), None))
    results.close()
    results.join_thread()
    if isinstance(out, dict) and "Timed out" in out.get("error", ""):
        # A rank that timed out stays alive until the harness kills it: exiting would close its
        # connections, and a rank still waiting on it would fail with "Connection closed" instead
        # of its own timeout (a race that a loaded machine loses).
        time.sleep(DEADLINE_S)
    os._exit(0)  # See [Note: Gloo teardown] in _harness.py.


def run_ranks_with_a_failure(fn, world_size: int, failing_rank: int, *args) -> dict[int, tuple]:
    """Run `fn(rank, world_size, *args)` on gloo ranks until every rank but `failing_rank` reported.

    Returns {rank: (traceback or None, result)} of the ranks that reported (a rank that exits
    reports nothing); `failing_rank` is killed if still alive. Fails if the ranks hang: no CPU used
    for DEADLINE_S ([Note: Timeouts that only catch hangs] in _harness.py).
    """
    ctx = rank_context()
    results = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="fsdp_graph_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, results, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes = {}
    watch = HangWatch(lambda: [p.pid for p in procs], DEADLINE_S)
    checked = time.monotonic()
    try:
        survivors = set(range(world_size)) - {failing_rank}
        while not survivors <= set(outcomes):
            try:
                rank, error, out = results.get(timeout=0.2)
                outcomes[rank] = (error, out)
            except queue.Empty:
                pass
            if time.monotonic() - checked > 2:
                checked = time.monotonic()
                why = watch.hung()
                if why is not None:
                    raise AssertionError(f"ranks {why}; reported: {sorted(outcomes)}")
        procs[failing_rank].join(timeout=1)  # one that raised reports on its way out
        while not results.empty():
            rank, error, out = results.get(timeout=1)
            outcomes[rank] = (error, out)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if os.path.exists(store_path):
            os.unlink(store_path)
    return outcomes


def _fail(how: str) -> None:
    if how == "raise":
        raise RuntimeError("injected failure on rank 1")  # propagates: the process ends
    if how == "exit":
        os._exit(1)
    if how == "stop":
        time.sleep(DEADLINE_S)  # alive, but takes no part in collectives (killed by the harness)


def _train_until_failure(rank, world_size, how, compiled, num_blocks, reshard_after_forward):
    torch.manual_seed(0)
    model = MLPStack(num_blocks=num_blocks)
    shard_blocks_then_root(model, reshard_after_forward=reshard_after_forward)
    run = torch.compile(model, backend=fsdp_graph.backend(compiler="aot_eager")) if compiled else model
    for step in range(3):
        x = torch.randn(4, 13)
        out = run(x)
        if step == 2 and rank == world_size - 1:
            _fail(how)
            return None
        start = time.monotonic()
        try:
            out.sum().backward()  # waits on the failed rank in a reduce-scatter or all-gather
        except RuntimeError as error:
            return {"seconds": time.monotonic() - start, "error": str(error)}
    return None


def _check_survivors(outcomes, world_size, how):
    failed = world_size - 1
    survivors = [r for r in range(world_size) if r != failed]
    for rank in survivors:
        assert rank in outcomes, f"rank {rank} never reported"
        error, out = outcomes[rank]
        assert error is None, f"rank {rank} raised outside the step:\n{error}"
        assert out is not None, f"rank {rank} finished the step although rank {failed} failed"
        if how == "stop":
            # The configured timeout, not gloo's default of 30 minutes, ended the wait.
            assert "Timed out" in out["error"], out["error"]
            assert PG_TIMEOUT_S - 0.5 <= out["seconds"] <= PG_TIMEOUT_S + 3, out
        else:
            assert "Connection" in out["error"] or "closed" in out["error"], out["error"]
            assert out["seconds"] <= 3, out
    if how == "raise":
        assert "injected failure" in outcomes[failed][0]
    return {r: round(outcomes[r][1]["seconds"], 3) for r in survivors}


@pytest.mark.parametrize(
    "how, compiled",
    # ("stop", True): over 7 s on a 2-core machine (docs/testing.md)
    [("raise", False), ("exit", False), ("stop", False), ("exit", True),
     pytest.param("stop", True, marks=pytest.mark.slow)],
)
def test_others_fail_within_timeout(how, compiled):
    outcomes = run_ranks_with_a_failure(_train_until_failure, 2, 1, how, compiled, 2, None)
    _check_survivors(outcomes, 2, how)


def test_smaller_reshard_groups_obey_the_timeout():
    # reshard_after_forward=2 of 4 ranks: backward re-gathers within pairs over groups fsdp_graph
    # creates itself, which must take the process group's timeout, not new_group's 30 minutes.
    outcomes = run_ranks_with_a_failure(_train_until_failure, 4, 3, "stop", False, 1, 2)
    _check_survivors(outcomes, 4, "stop")
