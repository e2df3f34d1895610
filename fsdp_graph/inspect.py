"""Print the summary of a graph dump: `python -m fsdp_graph.inspect DIR`.

DIR is what `FSDP_GRAPH_DUMP=DIR` or `fsdp_graph.backend(dump_dir=DIR)` wrote: collectives per
graph in order, bytes per group, and the modules that fell back to the eager hooks; then each
scheduled graph replayed on a hardware profile (`--profile h100-nvlink`): buckets, issue and wait
positions, prefetch distance, predicted exposed communication and peak memory (fsdp_graph/timeline.py),
and with `--timeline out.svg` (or .html) a picture of it.
"""

from __future__ import annotations

import argparse
import sys

from .dump import format_summary, load_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_graph.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a dump directory (FSDP_GRAPH_DUMP=DIR)")
    parser.add_argument("--profile", default="cpu-gloo", help="hardware profile to replay the schedules on: cpu-gloo, h100-nvlink, h100-infiniband")
    parser.add_argument("--timeline", help="also write an SVG (or .html) timeline of the schedules here")
    args = parser.parse_args(argv)
    try:
        summary = load_summary(args.directory)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(format_summary(summary))
    from .timeline import format_schedules, simulate_dump, write_timeline

    try:
        sims = simulate_dump(args.directory, args.profile)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(format_schedules(sims))
    if args.timeline:
        print(f"timeline: {write_timeline(args.timeline, sims)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
