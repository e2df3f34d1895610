"""What the example scripts share for watching a run: a progress display and a profiled step.

`progress` is tqdm's bar when tqdm is installed (the `progress` extra), rank 0 asks for one and
prints to a terminal, else a plain line every tenth of the run. `write_profile` records one step
with torch.profiler and writes its Chrome trace, which `python -m fsdp_graph.inspect DUMP --trace
out.json --measured <that file>` shows beside the predicted schedule.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Iterable, Optional

import torch

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


class _Lines:
    """tqdm's interface, as far as the examples use it, printing plain lines."""

    def __init__(self, iterable: Iterable, enabled: bool, initial: int, total: int) -> None:
        self.iterable, self.enabled, self.initial, self.total = iterable, enabled, initial, total
        self.postfix = ""

    def __iter__(self):
        start = time.perf_counter()
        every = max(1, self.total // 10)
        for done, item in enumerate(self.iterable, self.initial + 1):
            yield item
            if self.enabled and (done == self.initial + 1 or done == self.total or done % every == 0):
                rate = (done - self.initial) / (time.perf_counter() - start)
                print(f"step {done}/{self.total} {self.postfix} ({rate:.2f} it/s)", flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text


def progress(iterable: Iterable, enabled: bool, initial: int = 0, total: Optional[int] = None):
    total = total if total is not None else initial + len(iterable)
    if tqdm is not None and enabled and sys.stderr.isatty():  # a log file gets plain lines
        return tqdm(iterable, initial=initial, total=total, unit="step", dynamic_ncols=True)
    return _Lines(iterable, enabled, initial, total)


@contextlib.contextmanager
def write_profile(profile_dir: str, rank: int):
    """Profile the block (CPU, and CUDA when present); write `<profile_dir>/rank<rank>.json`."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(profile_dir, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    path = os.path.join(profile_dir, f"rank{rank}.json")
    prof.export_chrome_trace(path)
    print(f"rank {rank}: profile of one step in {path}", flush=True)
