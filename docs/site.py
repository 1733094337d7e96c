"""Build the docs as a small static site with MkDocs (`make docs`): README.md is its front page, docs/ the rest.

    python docs/site.py [--root REPO] [--out build/docs]     # the site in OUT/site

MkDocs reads one folder, so the pages are gathered into OUT/src first (README.md as index.md, its links into docs/
made relative to it), with mkdocs.yml pointed there; `mkdocs build --strict` then fails on any broken link or anchor.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path


def gather(root: Path, out: Path) -> Path:
    """docs/ (pages and figures) and README.md as index.md in ``out``/src, and the config for them; its path."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(root / "docs", out / "src", ignore=shutil.ignore_patterns("*.py", "*.json", "__pycache__"))
    (out / "src" / "index.md").write_text(re.sub(r"\]\(docs/", "](", (root / "README.md").read_text()))
    config = (root / "mkdocs.yml").read_text()
    config = re.sub(r"(?m)^docs_dir: .*$", "docs_dir: src", re.sub(r"(?m)^site_dir: .*$", "site_dir: site", config))
    (out / "mkdocs.yml").write_text(config)
    return out / "mkdocs.yml"


def main() -> int:
    here = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=here)
    p.add_argument("--out", type=Path, default=here / "build" / "docs")
    a = p.parse_args()
    config = gather(a.root.resolve(), a.out.resolve())
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)])


if __name__ == "__main__":
    sys.exit(main())
