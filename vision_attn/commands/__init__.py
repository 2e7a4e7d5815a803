"""The ``vision-attn`` tools besides fit/validate/test/predict, one function each that parses its options and calls
the library, registered by ``tool`` in ``TOOLS`` for ``cli.main``. Nothing heavy is imported before a tool runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from vision_attn.cli_arguments import bounded_int

TOOLS: dict[str, tuple[Callable[[Sequence[str]], None], str]] = {}
CANVAS_SIZE = bounded_int(28, 1024, "a 28-pixel garment is a speck on a larger canvas, which only costs memory")


def tool(name: str, summary: str) -> Callable:
    """Register a subcommand: ``summary`` is its line in ``vision-attn --help``."""
    return lambda command: TOOLS.setdefault(name, (command, summary))[0]


def canvas_background(options: argparse.Namespace) -> Any:
    """The ``Background`` a tool's ``canvas_background``, ``background_level`` and ``texture_source`` options name."""
    from vision_attn.data.backgrounds import Background
    return Background(options.background, options.background_level, options.texture_source)
