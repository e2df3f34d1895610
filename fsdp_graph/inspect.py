"""Print the summary of a graph dump: `python -m fsdp_graph.inspect DIR`.

DIR is what `FSDP_GRAPH_DUMP=DIR` or `fsdp_graph.backend(dump_dir=DIR)` wrote: collectives per
graph in order, bytes per group, and the modules that fell back to the eager hooks.
"""

from __future__ import annotations

import argparse
import sys

from .dump import format_summary, load_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_graph.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a dump directory (FSDP_GRAPH_DUMP=DIR)")
    args = parser.parse_args(argv)
    try:
        summary = load_summary(args.directory)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
