"""``--help`` from the config's own docstrings: each field's is the string under it in its dataclass."""

from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = nxt.value.value
    return docs


def help_lines(default: Any) -> list[str]:
    """Every key of a Config with its default and docstring, for ``--help``."""
    lines = ["usage: python -m trainer [config=FILE.yaml] [key=value ...]", ""]
    for group in fields(default):
        sub = getattr(default, group.name)
        lines.append(f"{group.name}:")
        docs = field_docs(type(sub))
        for f in fields(sub):
            key = f"{group.name}.{f.name}"
            lines.append(f"  {key}={getattr(sub, f.name)!s:<12} {docs.get(f.name, '')}")
    return lines
