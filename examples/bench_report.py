"""What the benchmark scripts share for `--markdown FILE`: their table as markdown, with the date,
the machine and the command that made it, ready for docs/benchmarks.md (which holds the latest run
of each benchmark; git keeps the earlier ones).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from typing import Sequence

import torch


def init_cpu_ranks() -> tuple[int, int]:
    """Join the gloo process group torchrun set up and split the cores between the ranks: (rank, world size)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return rank, world_size


def run_two_ranks(script: str, arguments: Sequence[str], out: str, cache_dir: str, what: str):
    """Run `script` with `arguments` under torchrun on 2 ranks, with Inductor's cache in `cache_dir` and
    one compile thread; the JSON it wrote to `out` (a RuntimeError naming `what` if it wrote none)."""
    if os.path.exists(out):  # from an earlier launch into the same folder
        os.remove(out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *arguments]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{what} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def parse_rows(parser, rows: str, names) -> list[str]:
    """The comma-separated `rows` of a benchmark's `--rows`, each one of `names` (else a parser error)."""
    chosen = [r.strip() for r in rows.split(",") if r.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"--rows names {unknown}; rows: {','.join(names)}")
    return chosen


def machine() -> str:
    """The machine in one line: OS and CPU, cores, accelerator, torch, and the ranks of this run."""
    parts = [platform.platform(), platform.processor() or platform.machine(), f"{os.cpu_count()} CPU cores"]
    if torch.cuda.is_available():
        parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    parts.append(f"torch {torch.__version__}")
    if "WORLD_SIZE" in os.environ:
        parts.append(f"{os.environ['WORLD_SIZE']} ranks")
    return ", ".join(parts)


def command() -> str:
    """The command line of this run, as torchrun was given it where torchrun started it."""
    args = shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    if "WORLD_SIZE" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']} {args}"
    return f"python {args}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(path: str, title: str, sections: Sequence[tuple[str, Sequence[str], Sequence[Sequence[object]]]],
                   notes: Sequence[str] = ()) -> str:
    """Write `## title`, the date, machine and command, then each (caption, header, rows) as a table
    and `notes` as lines after them. Returns `path`."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"## {title}", "", f"Run {now} on {machine()}.", "", f"Command: `{command()}`"]
    for caption, header, rows in sections:
        parts += ["", caption] if caption else []
        parts += ["", table(header, rows)]
    if notes:
        parts += [""] + list(notes)
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return path
