"""Inspection: graph dumps and their summary (dump.py), `python -m fsdp_graph.inspect DIR` (cli.py),
the predicted schedule as text and SVG (timeline.py) and as a Chrome trace (chrome_trace.py)."""

from .cli import main

__all__ = ["main"]
