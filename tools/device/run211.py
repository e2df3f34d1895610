"""Run a script with torch211.py's stand-ins, as on the device machine (torch 2.11 there):

    torchrun --nproc-per-node 1 tools/device/run211.py examples/device_check.py --modes compiled ...

with fsdp_graph importable (on the device machine: the package's folders copied under one
directory on PYTHONPATH, docs/benchmarks.md, One H200)."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch211  # noqa: E402,F401  (the stand-ins, before the script imports anything)

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
