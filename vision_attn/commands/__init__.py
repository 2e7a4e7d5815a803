"""The ``vision-attn`` tools besides fit/validate/test/predict, one function each: it parses its options and calls one
library function (``inference.py``: classify, caption, overlay, evaluate, explore; ``data.py``: export-samples,
make-scenes, rollout-mass, cache-features, benchmark; ``interventions.py``: erasure, deletion). ``tool`` registers
them in ``TOOLS``, which ``cli.main`` dispatches on. Nothing heavy is imported before a tool runs, so ``--help`` is
instant."""

from __future__ import annotations

from collections.abc import Callable, Sequence

TOOLS: dict[str, tuple[Callable[[Sequence[str]], None], str]] = {}


def tool(name: str, summary: str) -> Callable:
    """Register a subcommand: ``summary`` is its line in ``vision-attn --help``."""
    return lambda command: TOOLS.setdefault(name, (command, summary))[0]
