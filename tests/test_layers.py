"""The layers the folders promise, checked by import-linter's contracts in pyproject.toml.

`runtime/`, `traced/` and `passes/` are installed as `fsdp_graph.runtime`, `fsdp_graph.traced` and `fsdp_graph.passes` through
setuptools' package-dir mapping, which import-linter cannot see in an editable install. So the test
lays the four folders out as a wheel would (`fsdp_graph/`, `fsdp_graph/runtime/`, `fsdp_graph/traced/`,
`fsdp_graph/passes/`)
and runs `lint-imports` over that copy.
"""

import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _installed_layout(root: Path) -> Path:
    """Copy the package's sources to `root` the way the package-dir mapping installs them."""
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        target = root.joinpath(*package.split("."))
        for source in (REPO / folder).rglob("*.py"):  # subpackages too (fsdp_graph/api/, ...)
            copy = target / source.relative_to(REPO / folder)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, copy)
    return root


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", script, "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
    )


def test_contracts_kept(tmp_path):
    result = _lint_imports(_installed_layout(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout, result.stdout


def test_contracts_name_an_import_across_the_layers(tmp_path):
    """The imports the layering forbids, added back one per layer, break the contracts by name."""
    root = _installed_layout(tmp_path)
    added = {
        "traced/unshard.py": "from ..passes.nodes import is_collective",
        "runtime/state.py": "from ..traced import state",
        "runtime/param_group.py": "from .. import api",
        "passes/reshard.py": "from ..compile.backend import BackendConfig",
        "api/module.py": "from ..compile.backend import BackendConfig",
        "traced/ops.py": "from .state import TracedGroup",
    }
    for path, line in added.items():
        with open(root / "fsdp_graph" / path, "a") as f:
            f.write(f"\n{line}\n")
    result = _lint_imports(root)
    assert result.returncode != 0, result.stdout
    for importer, imported in [
        ("fsdp_graph.traced.unshard", "fsdp_graph.passes.nodes"),
        ("fsdp_graph.runtime.state", "fsdp_graph.traced"),
        ("fsdp_graph.runtime.param_group", "fsdp_graph.api"),
        ("fsdp_graph.passes.reshard", "fsdp_graph.compile.backend"),
        ("fsdp_graph.api.module", "fsdp_graph.compile.backend"),
        ("fsdp_graph.traced.ops", "fsdp_graph.traced.state"),
    ]:
        assert f"{importer} -> {imported}" in result.stdout, result.stdout


def test_every_face_module_is_forbidden_below_it_and_layered():
    folder = REPO / "fsdp_graph"
    face = {f"fsdp_graph.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"}
    face |= {f"fsdp_graph.{p.parent.name}" for p in folder.glob("*/__init__.py")}
    for contract in PYPROJECT["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "forbidden":
            missing = face - set(contract["forbidden_modules"])
            assert not missing, f"add {sorted(missing)} to the forbidden_modules of contract {contract['id']!r}"
        elif contract["id"] == "face":  # the face's own layers: every part of the face has its place
            layers = {f"fsdp_graph.{name.strip()}" for layer in contract["layers"] for name in layer.split("|")}
            missing = face - layers
            assert not missing, f"add {sorted(missing)} to the layers of contract {contract['id']!r}"
