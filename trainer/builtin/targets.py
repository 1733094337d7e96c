"""User code named by import path (``pkg.mod:attr`` or ``pkg.mod.attr``), resolved and called with clear errors.

Every failure (module not found, attribute missing, not callable, kwargs the factory does not take, the factory
raising, a wrong kind of result) is a :class:`UserError` naming the config key, raised before anything is written.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trainer.core.errors import UserError


def add_import_paths(extra: Iterable[str]) -> None:
    """Make the folder the job starts from, and each ``run.python_path`` folder, importable (first wins)."""
    for folder in [*extra, os.getcwd()][::-1]:
        path = os.path.abspath(folder)
        if path not in sys.path:
            sys.path.insert(0, path)


def _import(module: str, key: str, target: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise UserError(key, f"cannot import {module!r} (from {target!r}): no module named {exc.name!r}",
                            "start the job from the folder that holds the package, add that folder to "
                            "run.python_path=[...], or pip install the package") from None
        raise _raised(key, f"importing {module!r}", exc) from None
    except Exception as exc:  # the user's module itself fails while importing
        raise _raised(key, f"importing {module!r}", exc) from None


def _raised(key: str, doing: str, exc: BaseException) -> UserError:
    """An exception from the user's code: its last frame in their file, not our traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/trainer/" not in f.filename.replace(os.sep, "/")]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return UserError(key, f"{doing} raised {type(exc).__name__}: {exc}{where}",
                     "fix that code; run it alone (python -c 'import …') to see the whole traceback")


def resolve(target: str, key: str) -> Any:
    """The object ``target`` names: ``pkg.mod:attr.sub`` or the dotted ``pkg.mod.attr`` (longest importable module)."""
    target = target.strip()
    if not target or target.startswith((".", ":")) or target.count(":") > 1:
        raise UserError(key, f"{target!r} is not an import path",
                        f"write module:attribute or module.attribute, e.g. {key}=mypkg.nets:TinyViT")
    if ":" in target:
        module, attr = target.split(":")
        obj = _import(module, key, target)
        names = attr.split(".") if attr else []
    else:
        parts = target.split(".")
        if len(parts) < 2:
            raise UserError(key, f"{target!r} names a module, not something in it",
                            f"add the attribute, e.g. {key}={target}:build")
        for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
            module = ".".join(parts[:cut])
            try:
                if importlib.util.find_spec(module) is not None:
                    break
            except Exception:  # a parent that is a plain module, or fails to import: a shorter prefix will say
                continue
        else:
            module = parts[0]
        obj, names = _import(module, key, target), parts[len(module.split(".")):]
    for i, name in enumerate(names):
        if not hasattr(obj, name):
            where = ".".join([module, *names[:i]])
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:12]
            raise UserError(key, f"{where!r} has no attribute {name!r}",
                            f"check the spelling; it defines: {', '.join(public) or 'nothing public'}")
        obj = getattr(obj, name)
    return obj


def prepare(target: str, kwargs: Mapping[str, Any], key: str, what: str,
            given: Mapping[str, Any] | None = None) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Resolve ``target`` and check that it can be called with ``kwargs``, without calling it.

    ``given`` are arguments the runtime offers (e.g. ``num_classes``): passed only to parameters that exist.
    """
    fn = resolve(target, key)
    if not callable(fn):
        raise UserError(key, f"{target!r} is a {type(fn).__name__}, not a class or function",
                        f"name a factory that returns {what}")
    kwargs = dict(kwargs)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: calling will tell
        return fn, kwargs
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    for name, value in (given or {}).items():
        if name not in kwargs and (name in sig.parameters or takes_any):
            kwargs[name] = value
    try:
        sig.bind(**kwargs)
    except TypeError as exc:
        params = ", ".join(p for p in sig.parameters if p != "self") or "none"
        kwkey = key.rsplit(".", 1)[0] + ".kwargs"
        raise UserError(kwkey, f"{target!r} does not take these arguments ({exc})",
                        f"its parameters: {params}; set them as {kwkey}.NAME=VALUE") from None
    return fn, kwargs


def build(target: str, kwargs: Mapping[str, Any], key: str, expect: tuple[type, ...] | Callable[[Any], bool],
          what: str, given: Mapping[str, Any] | None = None) -> Any:
    """:func:`prepare`, call, and check the result: ``expect`` is the types it must have, or a predicate;
    ``what`` describes it for the error."""
    fn, kwargs = prepare(target, kwargs, key, what, given)
    try:
        obj = fn(**kwargs)
    except Exception as exc:
        raise _raised(key, f"{target}(...)", exc) from None
    ok = isinstance(obj, expect) if isinstance(expect, tuple) else expect(obj)
    if not ok:
        raise UserError(key, f"{target!r} returned {type(obj).__module__}.{type(obj).__qualname__}, not {what}",
                        f"make it return {what}")
    return obj


def describe(target: str, key: str) -> dict[str, str]:
    """What ``target`` resolved to: its canonical ``module:qualname`` and source file (for checkpoints and W&B)."""
    obj = resolve(target, key)
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    return {"target": f"{module}:{name}", "file": str(getattr(sys.modules.get(module), "__file__", None) or "")}
