"""Shared helpers for the tests."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


def console_script() -> str:
    """The installed ``vision-attn`` entry point of the interpreter running the tests."""
    script = Path(sys.executable).parent / "vision-attn"
    found = str(script) if script.exists() else shutil.which("vision-attn")
    if not found:
        raise RuntimeError("the vision-attn console script is not installed; run `make setup`")
    return found
