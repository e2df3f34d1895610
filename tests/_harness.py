"""Run a test body on several gloo ranks (processes from a fork server, file store, a deadline per test)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist

from fsdp_graph.predict import fake_world

DEFAULT_TIMEOUT_S = 180


def _crash_path(store_path: str, rank: int) -> str:
    return f"{store_path}.crash{rank}"


def _rank_main(fn, rank, world_size, store_path, results, timeout_s, args) -> None:
    # A fatal signal (a segfault) leaves no Python traceback to report: faulthandler writes every
    # thread's stack to a file the parent reads if the rank dies. The file stays open until exit.
    crash_file = open(_crash_path(store_path, rank), "w")
    faulthandler.enable(file=crash_file, all_threads=True)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Pickled here, not in the queue's feeder thread, so an unpicklable result fails the test.
        out = pickle.dumps(fn(rank, world_size, *args))
        dist.barrier()
        results.put((rank, None, out))
    except BaseException:  # report every failure, including SystemExit, to the parent
        results.put((rank, traceback.format_exc(), None))
    # [Note: Gloo teardown] With torch 2.13, tearing down gloo process groups (explicitly or at
    # interpreter exit) aborts now and then with "terminate called without an active exception",
    # also in scripts that never import fsdp_graph. The rank's result is already sent, so leave
    # without running any destructor.
    results.close()
    results.join_thread()
    os._exit(0)


def rank_context():
    """The multiprocessing context ranks start from.

    A fork server: each rank is forked from one clean process that imported torch and fsdp_graph
    once, so ranks start fast but inherit nothing from earlier tests in the pytest process (fake
    process groups, meshes, Dynamo caches, garbage that would skew live-tensor counts).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fsdp_graph", "_harness", "_models", "_forkserver_warmup"])
    # The fork server imports its preloads on the interpreter's own sys.path, not on this process's
    # (Python 3.11), and skips those it cannot import without a word: this directory goes on its
    # PYTHONPATH while it starts, or the test modules above would be imported again in every rank.
    here = os.path.dirname(os.path.abspath(__file__))
    search_path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    with mock.patch.dict(os.environ, {"PYTHONPATH": search_path}):
        multiprocessing.forkserver.ensure_running()
    return ctx


def run_ranks(fn: Callable, world_size: int = 2, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return rank 0's result.

    A failure on any rank fails the test with that rank's traceback; ranks still running after
    `timeout_s` are killed and the test fails, so a hang never blocks the suite.
    """
    ctx = rank_context()
    results = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="fsdp_graph_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, results, timeout_s, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple] = {}
    try:
        while len(outcomes) < world_size:
            try:
                rank, error, out = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s}s") from None
            outcomes[rank] = (error, out)
            if error is not None:
                break
    finally:
        for p in procs:
            p.join(timeout=5 if len(outcomes) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        if os.path.exists(store_path):
            os.unlink(store_path)
        crashes = {r: _read_and_remove(_crash_path(store_path, r)) for r in range(world_size)}
    errors = [f"rank {r}:\n{e}" for r, (e, _) in sorted(outcomes.items()) if e is not None]
    # A rank that died of a signal shows in the others only as "Connection reset by peer": name it
    # (-9: killed here, after another rank's failure), with the stacks faulthandler wrote.
    errors += [f"rank {r} died without a report: exit code {p.exitcode}\n{crashes[r]}" for r, p in enumerate(procs)
               if r not in outcomes and p.exitcode not in (None, 0, -signal.SIGKILL)]
    if errors:
        raise AssertionError("\n".join(errors))
    return pickle.loads(outcomes[0][1])


def _read_and_remove(path: str) -> str:
    try:
        with open(path) as f:
            text = f.read()
        os.unlink(path)
    except OSError:
        return ""
    return text


# A fake process group of any size in this process (shapes right, data not), as a context manager.
fake_process_group = fake_world
