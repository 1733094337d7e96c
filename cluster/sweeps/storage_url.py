"""A sweep's database URL without leaking its password: shown and recorded with the password hidden (as SQLAlchemy
renders it), kept for the workers in a file only this user can read (``<sweep>/storage-url``, mode 600, as
``~/.pgpass`` is), or left out of the spec and taken from ``$SWEEP_DB_PASSWORD``."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

PASSWORD_ENV = "SWEEP_DB_PASSWORD"
"""The database password, for a ``storage`` URL written without one (sbatch passes it on to the workers)."""
SECRET = "storage-url"
"""The whole URL, password included, in the sweep folder, readable by its owner alone."""


def _parsed(url: str) -> object | None:
    if url == "journal":
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url)
    except ArgumentError:
        return None


def hidden(url: str) -> str:
    """The URL as it may be printed and recorded: its password as ``***``."""
    parsed = _parsed(url)
    return parsed.render_as_string(hide_password=True) if parsed is not None else url  # type: ignore[attr-defined]


def has_password(url: str) -> bool:
    parsed = _parsed(url)
    return parsed is not None and bool(parsed.password)  # type: ignore[attr-defined]


def with_env_password(url: str) -> str:
    """The URL to connect with: a password from ``$SWEEP_DB_PASSWORD`` when it holds none."""
    parsed = _parsed(url)
    password = os.environ.get(PASSWORD_ENV)
    if parsed is None or parsed.password or not password or not parsed.username:  # type: ignore[attr-defined]
        return url
    return parsed.set(password=password).render_as_string(hide_password=False)  # type: ignore[attr-defined]


def keep(url: str, sweep_dir: Path) -> None:
    """For the workers: a URL holding a password goes into ``<sweep>/storage-url``, mode 600 from its creation."""
    if not has_password(url):
        return
    path = sweep_dir / SECRET
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(url + "\n")
    os.chmod(path, 0o600)  # an older file of the same name keeps its mode through O_TRUNC


def connect_url(recorded: str, sweep_dir: Path) -> str:
    """The URL a worker connects with: the kept one, else the recorded one (password hidden or absent) with the
    password from the environment."""
    path = sweep_dir / SECRET
    if recorded != "journal" and path.exists():
        return path.read_text().strip()
    return with_env_password(recorded)


def warn_if_exposed(spec_path: Path, url: str) -> None:
    """One warning when a spec file holding a database password can be read by other users."""
    try:
        mode = spec_path.stat().st_mode
    except OSError:
        return
    if has_password(url) and mode & (stat.S_IRGRP | stat.S_IROTH):
        print(f"warning: {spec_path} holds a database password and other users can read it: `chmod 600 {spec_path}`, "
              f"or write the URL without the password and set {PASSWORD_ENV}", file=sys.stderr)
