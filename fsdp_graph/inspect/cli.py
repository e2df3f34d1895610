"""Print the summary of a graph dump: `python -m fsdp_graph.inspect DIR`.

DIR is what `FSDP_GRAPH_DUMP=DIR` or `fsdp_graph.backend(dump_dir=DIR)` wrote: collectives per
graph in order, bytes per group, and the modules that fell back to the eager hooks; then each
scheduled graph replayed on a hardware profile (`--profile h100-nvlink`): buckets, issue and wait
positions, prefetch distance, predicted exposed communication and peak memory (fsdp_graph/inspect/timeline.py),
with `--timeline out.svg` (or .html) a picture of it, and with `--trace out.json` a Chrome trace
(Perfetto, chrome://tracing) of it, beside a measured torch.profiler trace with `--measured`
(fsdp_graph/inspect/chrome_trace.py). `--measured` alone prints the eager runtime's all-gathers in
that trace and the hook that issued each (prefetches), for groups no graph predicts (compile scope
"block", fallbacks, eager mode). The summary ends with the seconds each pass took on each graph.
`python -m fsdp_graph.inspect --passes` prints the table of passes (passes/table.py): what each
is called in `disabled_passes`, where it runs, the options it reads and what it does.
"""

from __future__ import annotations

import argparse
import sys

from ..passes.table import format_table
from .dump import format_summary, load_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_graph.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="a dump directory (FSDP_GRAPH_DUMP=DIR)")
    parser.add_argument("--passes", action="store_true", help="print the table of passes (markdown) and exit")
    parser.add_argument("--profile", default="cpu-gloo", help="hardware profile to replay the schedules on: cpu-gloo, h100-nvlink, h100-infiniband")
    parser.add_argument("--timeline", help="also write an SVG (or .html) timeline of the schedules here")
    parser.add_argument("--trace", help="also write the predicted schedule as a Chrome trace (Perfetto) here")
    parser.add_argument("--measured", help="a torch.profiler Chrome trace of the same step: the eager runtime's all-gathers in it "
                                           "(which hook issued each: prefetches), and beside the prediction in --trace")
    args = parser.parse_args(argv)
    if args.passes:
        print(format_table(), end="")
        return 0
    if args.directory is None:
        parser.error("a dump directory is needed (or --passes)")
    try:
        summary = load_summary(args.directory)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(format_summary(summary))
    from .chrome_trace import eager_gathers, format_eager_gathers, read_trace, write_trace
    from .timeline import format_schedules, simulate_dump, write_timeline

    try:
        programs, sims = simulate_dump(args.directory, args.profile)
        print(format_schedules(programs, sims))
        if args.timeline:
            print(f"timeline: {write_timeline(args.timeline, sims)}")
        measured = read_trace(args.measured) if args.measured else None
        if measured is not None:
            print(format_eager_gathers(eager_gathers(measured)))
        if args.trace:
            print(f"trace: {write_trace(args.trace, sims, programs, measured)}")
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    return 0

