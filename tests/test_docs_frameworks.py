"""The scripts on the pages of docs/frameworks/ run as written, and train as the same framework does on
torch's `fully_shard` (issue #79).

A page's script is a fenced ```python block whose first line is the command that runs it:

    # torchrun --nproc-per-node 2 NAME.py [OPTIONS]

Every ```python block on those pages must be one. The test writes each to a folder of its own and
runs it on 2 gloo ranks through tests/frameworks/run_doc_script.py, which runs it unchanged and
then saves which `fully_shard` sharded the model it leaves behind (its `trainer.model`, else its
`model`) and that model's full parameters. Each script runs twice for each row of `CASES`:
  - as written (fsdp_graph's `fully_shard`, with the row's options);
  - as torch's reference: the lines that bring in fsdp_graph swapped for torch's (`SWAPS`), and
    `--compile` dropped, since torch's `fully_shard` has no whole-step compile.
The test checks that the page's run sharded with fsdp_graph and the reference with torch, over 2
ranks, then compares the losses the script prints (`losses: [...]` on rank 0) and every final
parameter: equal bit for bit in eager, and for the whole step under Inductor (`--compile`) within
the tolerances below (Inductor's kernels are not torch's eager ops).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "frameworks"
RUNNER = ROOT / "tests" / "frameworks" / "run_doc_script.py"
COMMAND = "# torchrun --nproc-per-node 2 "
# The whole step under Inductor against torch's eager run: each loss within INDUCTOR_LOSS_RTOL of
# torch's, and each final parameter within INDUCTOR_PARAM_RTOL of torch's in norm. Adam turns the
# last bits in which Inductor's gradients differ into updates of up to the learning rate on elements
# whose gradient is near zero, so parameters are compared in norm and more loosely than losses. A
# missing or misdirected gradient, with the pages' learning rate 1e-2 on weights initialised at a
# scale of 0.02, moves a tensor by far more. (Adam hides a gradient scaled as a whole, in the
# losses as in the parameters.)
INDUCTOR_LOSS_RTOL = 1e-5
INDUCTOR_PARAM_RTOL = 1e-3

# The lines that bring in fsdp_graph, each with torch's own: what the reference run has instead.
SWAPS = {
    "fsdp_graph.use_in_place_of_torch_fsdp()": "pass  # torch's fully_shard",
    "from fsdp_graph import fully_shard": "from torch.distributed.fsdp import fully_shard",
}

# Each page script: the package it needs, and the options it is run with (one run per tuple).
CASES = {
    "accelerate_fsdp2.py": ("accelerate", [(), ("--compile",)]),
    "lightning_fabric.py": ("lightning", [(), ("--compile",)]),
    "peft_lora.py": ("peft", [(), ("--compile",)]),
    "trl_sft.py": ("trl", [(), ("--accumulation", "2"), ("--compile",), ("--accumulation", "2", "--compile")]),
    "trl_dpo.py": ("trl", [(), ("--compile",)]),
    "torchtitan_llama3.py": ("torchtitan", [(), ("--compile",)]),
}


def page_scripts() -> dict[str, tuple[str, str]]:
    """Every ```python block of docs/frameworks/: {script name: (page, source)}."""
    scripts = {}
    for page in sorted(PAGES.glob("*.md")):
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            first = block.splitlines()[0]
            assert first.startswith(COMMAND), (
                f"{page.name}: a python block that is not a script to run; its first line must be "
                f"'{COMMAND}NAME.py ...', got {first!r}"
            )
            name = first.removeprefix(COMMAND).split()[0]
            assert name not in scripts, f"{page.name}: {name} is also on {scripts[name][0]}"
            scripts[name] = (page.name, block)
    return scripts


def torch_reference(source: str) -> str:
    swapped = source
    for ours, theirs in SWAPS.items():
        swapped = swapped.replace(ours, theirs)
    assert swapped != source, "the script does not bring in fsdp_graph by any line in SWAPS"
    return swapped


@functools.lru_cache(maxsize=None)
def run(name: str, reference: bool, args: tuple[str, ...], work: Path) -> dict:
    """Run a page's script on 2 ranks: its losses, what sharded it and its final parameters."""
    _, source = page_scripts()[name]
    folder = work / ("torch" if reference else "ours") / "-".join((name, *args))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(torch_reference(source) if reference else source)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(RUNNER), str(folder / "out"), name, *args,
    ]
    # examples/ on the path, as docs/frameworks/torchtitan.md says to run its script.
    path = os.pathsep.join(filter(None, [str(ROOT / "examples"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=900, env=env)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{name} {' '.join(args)} exited with {done.returncode}:\n{output}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("losses:")]
    losses = [json.loads(line.removeprefix("losses:")) for line in lines]
    assert len(losses) == 1, f"{name} printed {len(losses)} 'losses:' lines:\n{output}"
    result = json.loads((folder / "out" / "result.json").read_text())
    result["losses"] = losses[0]
    result["params"] = torch.load(folder / "out" / "params.pt")
    return result


def test_every_page_script_has_cases():
    """Each script on the pages is run by the test below, and each script the test names is on a page."""
    assert set(page_scripts()) == set(CASES)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, args",
    [pytest.param(name, args, id="-".join((name, *args))) for name, (_, runs) in CASES.items() for args in runs],
)
def test_page_script_trains_as_torch_fully_shard(name, args, tmp_path_factory):
    package, _ = CASES[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed: pip install -e '.[frameworks]'")
    work = tmp_path_factory.getbasetemp() / "docs_frameworks"
    ours = run(name, False, args, work)
    theirs = run(name, True, tuple(a for a in args if a != "--compile"), work)

    assert ours["world_size"] == theirs["world_size"] == 2
    assert ours["sharded_by"]["fsdp_graph"] > 0 and ours["sharded_by"]["torch"] == 0, ours["sharded_by"]
    assert theirs["sharded_by"]["torch"] > 0 and theirs["sharded_by"]["fsdp_graph"] == 0, theirs["sharded_by"]
    assert len(ours["losses"]) == len(theirs["losses"]) >= 4 and len(set(theirs["losses"])) > 1
    assert ours["params"].keys() == theirs["params"].keys()
    if "--compile" not in args:
        assert ours["losses"] == theirs["losses"]
        for key, value in theirs["params"].items():
            assert torch.equal(ours["params"][key], value), key
        return
    for step, (got, expected) in enumerate(zip(ours["losses"], theirs["losses"]), 1):
        assert abs(got - expected) <= INDUCTOR_LOSS_RTOL * abs(expected), f"step {step}: {got} vs torch's {expected}"
    for key, value in theirs["params"].items():
        error = torch.linalg.vector_norm(ours["params"][key] - value) / torch.linalg.vector_norm(value)
        assert error <= INDUCTOR_PARAM_RTOL, f"{key}: off torch's by {error:.2e} of its norm"
