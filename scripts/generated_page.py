"""Writing, or with ``--check`` comparing, a documentation page that a script generates (the command-line and
configuration references), so that the test suite can tell a stale page in one line."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_or_check(target: Path, text: str, *, check: bool) -> None:
    """Write ``text`` to ``target``; with ``check``, write nothing and exit 1 if ``target`` does not hold it,
    naming the script (the caller) that rewrites it."""
    script = Path(sys.argv[0]).name
    if check:
        if not target.is_file() or target.read_text(encoding="utf-8") != text:
            print(f"{target.relative_to(ROOT)} is not current: run python scripts/{script}", file=sys.stderr)
            sys.exit(1)
        return
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target.relative_to(ROOT)}")
