"""Run a test body on several gloo ranks (processes from a fork server, file store, a hang watchdog)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import subprocess
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional
from unittest import mock

import torch
import torch.distributed as dist

from fsdp_graph.predict import fake_world

# [Note: Timeouts that only catch hangs]
# A rank that waits on a peer that will never answer uses no CPU; a rank that compiles on a loaded
# machine is slow but busy. So the ranks are called hung when they and their child processes (the
# C++ compiler's included) used almost no CPU for `timeout_s` seconds in a row, not when a test
# takes longer than some fixed time: a machine shared by other jobs makes the second one fail
# tests that were fine. The process group's own timeout is `HANG_CAP_S`, far above any test's run,
# so a rank that waits in a collective for a busy peer is not failed by gloo either; the watchdog
# kills hung ranks long before. `HANG_CAP_S` also ends ranks that spin without progress.
DEFAULT_TIMEOUT_S = 180
HANG_CAP_S = 3600
_BUSY_CPU_FRACTION = 0.01  # of one core, over the window: below it the ranks are idle (hung)
_POLL_S = 2.0


def _crash_path(store_path: str, rank: int) -> str:
    return f"{store_path}.crash{rank}"


def _rank_main(fn, rank, world_size, store_path, results, args) -> None:
    # A fatal signal (a segfault, an abort) leaves no Python traceback to report: faulthandler writes
    # every thread's stack to a file the parent reads if the rank dies. The rank's stderr goes there
    # too, for what C++ says before an abort ("terminate called after throwing ..."): the fork
    # server's stderr, which ranks would inherit, is whatever pytest captured when it started. The
    # file stays open until exit.
    crash_file = open(_crash_path(store_path, rank), "w")
    os.dup2(crash_file.fileno(), 2)
    faulthandler.enable(file=crash_file, all_threads=True)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=HANG_CAP_S),
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


def _cpu_seconds_of_trees(pids: list[int]) -> Optional[float]:
    """CPU seconds used so far by the processes `pids` and their living descendants (Linux's
    /proc); None where /proc cannot say."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        times[pid] = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
    if not any(pid in times for pid in pids):
        return None
    total, stack, seen = 0.0, list(pids), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += times.get(pid, 0.0)
        stack += children.get(pid, [])
    return total


class HangWatch:
    """Says when processes have been idle (hung) for `timeout_s`: [Note: Timeouts that only catch
    hangs]. Where /proc cannot tell, it falls back to `timeout_s` of wall-clock time."""

    def __init__(self, pids: Callable[[], list[int]], timeout_s: float) -> None:
        self.pids, self.timeout_s = pids, timeout_s
        self.start = self.since = time.monotonic()
        self.cpu = _cpu_seconds_of_trees(pids())

    def hung(self) -> Optional[str]:
        """Why the processes count as hung now, or None while they work."""
        now = time.monotonic()
        if now - self.start > HANG_CAP_S:
            return f"still running after {HANG_CAP_S}s"
        cpu = _cpu_seconds_of_trees(self.pids())
        if cpu is None or self.cpu is None:
            return f"did not finish within {self.timeout_s}s" if now - self.start > self.timeout_s else None
        if cpu - self.cpu > _BUSY_CPU_FRACTION * max(now - self.since, _POLL_S):
            self.since, self.cpu = now, cpu  # busy: the window starts again
            return None
        if now - self.since > self.timeout_s:
            return f"used no CPU for {self.timeout_s}s (a hang)"
        return None


def run_process(command: list[str], timeout_s: float = DEFAULT_TIMEOUT_S, **popen_kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, ...)` whose process is killed, and
    the test failed, only when it hangs ([Note: Timeouts that only catch hangs])."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True, **popen_kwargs)
        watch = HangWatch(lambda: [process.pid], timeout_s)
        while process.poll() is None:
            why = watch.hung()
            if why is not None:
                process.kill()
                process.wait()
                err.seek(0)
                raise AssertionError(f"{command[:3]} {why}; its stderr ends:\n{err.read()[-3000:]}")
            time.sleep(_POLL_S)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, out.read(), err.read())


def run_ranks(fn: Callable, world_size: int = 2, *args, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return rank 0's result.

    A failure on any rank fails the test with that rank's traceback; ranks that use no CPU for
    `timeout_s` seconds in a row (waiting on each other: a hang) are killed and the test fails, so
    a hang never blocks the suite, while a slow machine does not fail a busy test ([Note: Timeouts
    that only catch hangs]).
    """
    ctx = rank_context()
    results = ctx.Queue()
    fd, store_path = tempfile.mkstemp(prefix="fsdp_graph_store_")
    os.close(fd)
    os.unlink(store_path)
    procs = [
        ctx.Process(target=_rank_main, args=(fn, r, world_size, store_path, results, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple] = {}
    stopped = None  # why the ranks that never reported stopped, if they did
    watch = HangWatch(lambda: [p.pid for p in procs if p.pid is not None], timeout_s)
    try:
        while len(outcomes) < world_size:
            try:
                rank, error, out = results.get(timeout=_POLL_S)
            except queue.Empty:
                why = watch.hung()
                if all(not procs[r].is_alive() for r in range(world_size) if r not in outcomes):
                    why = "exited without a report"
                if why is not None:
                    stopped = f"ranks {sorted(set(range(world_size)) - set(outcomes))} {why}"
                    break
                continue
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
    # A rank that died of a signal shows in the others only as "Connection reset by peer": name it
    # first (-9: killed here, after another rank's failure), with its stderr and the stacks
    # faulthandler wrote.
    errors = [f"rank {r} died without a report: exit code {p.exitcode}; its stderr:\n{crashes[r]}"
              for r, p in enumerate(procs) if r not in outcomes and p.exitcode not in (None, 0, -signal.SIGKILL)]
    errors += [f"rank {r}:\n{e}" for r, (e, _) in sorted(outcomes.items()) if e is not None]
    errors += [stopped] if stopped else []
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
