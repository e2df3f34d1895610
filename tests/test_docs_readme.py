"""README's code runs as written.

README's python blocks are either a complete script (run here under torchrun on 2 gloo ranks, as
README says to run it) or a partial one whose first line says "# Partial:" and where it belongs.
The complete script trains with our `fully_shard` and, with its import line swapped, with torch's:
the losses must be the same. Its `COMPILE = True` (the fsdp_graph backend, Inductor) and each
partial line that replaces its `torch.compile` line must train as its eager run does (bit for bit
with `aot_eager`, within Inductor's rounding otherwise). Every `fsdp_graph.backend(...)` call in
README must build a backend, every linked file must exist, and README must stay a guide: at most
250 lines, no dates, opening with the bash block of two commands that .ci/run reads.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

import pytest

import fsdp_graph
from _harness import run_process
from fsdp_graph.compile.backend import FSDPGraphBackend

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PARTIAL = "# Partial:"
OURS_IMPORT = "from fsdp_graph import fully_shard"
TORCH_IMPORT = "from torch.distributed.fsdp import fully_shard"
COMPILE_LINE = 'step = torch.compile(model, backend="fsdp_graph") if COMPILE else model'


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def _script() -> str:
    complete = [b for b in _blocks("python") if not b.startswith(PARTIAL)]
    assert len(complete) == 1, f"README should hold one complete script, found {len(complete)}"
    return complete[0]


def _partial_compile_lines() -> list[str]:
    """The lines of README's partial blocks that replace the script's torch.compile line."""
    lines = []
    for block in _blocks("python"):
        if block.startswith(PARTIAL) and "torch.compile line" in block.splitlines()[0]:
            lines += [line for line in block.splitlines()[1:] if line.startswith("step = torch.compile(")]
    return lines


def _train(script: str, tmp_path: Path, name: str) -> list[float]:
    """Run `script` as README says (torchrun, 2 ranks); rank 0's losses."""
    path = tmp_path / f"readme_{name}.py"  # not torch.py: the script dir comes first on sys.path
    path.write_text(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = run_process([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(path)], env=env, cwd=tmp_path)
    losses = [float(m) for m in re.findall(r"^step \d+ loss (\S+)$", done.stdout, flags=re.M)]
    assert done.returncode == 0 and len(losses) == 5, (done.stdout + done.stderr)[-4000:]
    return losses


def test_readme_is_a_guide_that_opens_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession \d+", text), "dates and work periods go to docs/benchmarks.md"
    first = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()  # what .ci/run reads
    assert len(first) == 2 and first[1] == "python -m pytest -q tests", first
    assert text.index("```bash") < text.index("```python")


def test_readme_links_point_to_files():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        assert (REPO / target).exists(), target
    for path in re.findall(r"`((?:examples|docs|tests|tools)/[\w/.]+\.(?:py|md))`", README.read_text()):
        assert (REPO / path).exists(), path


def test_readme_python_blocks_parse_and_partial_ones_say_where_they_belong():
    blocks = _blocks("python")
    for block in blocks:
        ast.parse(block)
        if block.startswith(PARTIAL):
            assert len(block.splitlines()[0]) > len(PARTIAL) + 10, f"say where the lines go: {block.splitlines()[0]}"
    assert COMPILE_LINE in _script() and OURS_IMPORT in _script()
    assert _partial_compile_lines(), "README's compile options should be lines that replace the script's torch.compile line"


def test_readme_backend_calls_build_backends():
    """Every `fsdp_graph.backend(...)` README shows takes its options (a misspelt option raises)."""
    calls = [node for block in _blocks("python") for node in ast.walk(ast.parse(block))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "fsdp_graph.backend"]
    assert len(calls) >= 3
    for call in calls:
        backend = eval(compile(ast.Expression(call), "README.md", "eval"), {"fsdp_graph": fsdp_graph})
        assert isinstance(backend, FSDPGraphBackend)


@pytest.mark.slow  # relaunches: torchrun, twice
def test_readme_script_trains_as_torch_fully_shard(tmp_path):
    ours = _train(_script(), tmp_path, "ours")
    theirs = _train(_script().replace(OURS_IMPORT, TORCH_IMPORT), tmp_path, "torch")
    assert ours == theirs, (ours, theirs)
    assert ours[-1] < ours[0], ours


@pytest.mark.slow  # relaunches, compiles cold with Inductor
def test_readme_script_compiled_trains_as_eager(tmp_path):
    script = _script()
    eager = _train(script, tmp_path, "eager")
    compiled = _train(script.replace("COMPILE = False", "COMPILE = True", 1), tmp_path, "compiled")
    assert compiled == pytest.approx(eager, rel=1e-4), (compiled, eager)
    for i, line in enumerate(_partial_compile_lines()):
        losses = _train(script.replace(COMPILE_LINE, line), tmp_path, f"partial{i}")
        if 'compiler="aot_eager"' in line:
            assert losses == eager, (line, losses, eager)
        else:
            assert losses == pytest.approx(eager, rel=1e-4), (line, losses, eager)
