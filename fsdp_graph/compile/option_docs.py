"""The backend's options as documentation: each field's docstring, and the options table of
docs/compiler.md (`python tools/options_table.py` prints it; tests/test_pass_table.py
checks that the docs hold what it prints).

A field of `BackendConfig` is documented by the string literal under it, as torchtitan's configs
are; the options the passes read (passes/table.py's `Option`s) carry their own `doc`.
"""

from __future__ import annotations

import ast
import enum
import inspect
import textwrap
import typing
from dataclasses import MISSING, fields
from typing import Any

from ..passes.table import OPTIONS, PASSES


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated field of `cls`'s body, by field name, in order, with
    its lines joined; none where the class's source is not installed (only compiled files), so
    that the backend still imports."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body
    docs = {}
    for statement, following in zip(body, body[1:]):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _choices(annotation: Any) -> list[str]:
    """The values a field's annotation allows, spelled as Python does, where it names a closed set
    (a `Literal`, an `Enum`, a bool); empty otherwise."""
    if isinstance(annotation, str):
        return []
    if typing.get_origin(annotation) is typing.Literal:
        return [repr(a) for a in typing.get_args(annotation)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [repr(member.value) for member in annotation]
    if annotation is bool:
        return ["True", "False"]
    return []


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else MISSING


def _spell(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, frozenset):
        return "empty" if not value else repr(sorted(value))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and value & (value - 1) == 0:
        return f"1 << {value.bit_length() - 1}"
    return repr(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_table(config_class: type) -> str:
    """Every option of `fsdp_graph.backend(...)` (`config_class`, i.e. `BackendConfig`) as a
    markdown table: name, default, values, what it does."""
    hints = typing.get_type_hints(config_class, include_extras=True)
    docs = field_docs(config_class)
    pass_options = {o.name: o for o in OPTIONS}
    lines = ["| option | default | values | what it does |", "|---|---|---|---|"]
    for f in fields(config_class):
        option = pass_options.get(f.name)
        if option is not None:
            readers = ", ".join(f"`{spec.name}`" for spec in PASSES if option in spec.reads())
            doc, values = f"{option.doc} Read by {readers}.", f"e.g. `{_spell(option.example)}`"
        else:
            doc = docs[f.name]
            choices = _choices(hints[f.name])
            values = ", ".join(f"`{c}`" for c in choices) if choices else f"`{_annotation(hints[f.name])}`"
        lines.append(f"| `{f.name}` | `{_spell(_default(f))}` | {_cell(values)} | {_cell(doc)} |")
    return "\n".join(lines) + "\n"


def _annotation(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "")

