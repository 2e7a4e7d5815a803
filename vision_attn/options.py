"""The command line's option types and the options several tools share: parsed and range-checked at the edge,
so a bad value is one argparse line before any work is done."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low``."""
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, got {text!r}")
        return int(text)
    return parse


SHARED_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {  # options several tools take, by name
    "device": (("--device",), {"default": "cpu", "help": "torch device (default cpu)"}),
    "bad_images": (("--on-bad-image",), {"choices": ["error", "skip"], "default": "error",
                                         "help": "an unreadable image stops the run (default) or is skipped"}),
    "head_fusion": (("--head-fusion",), {"choices": ["mean", "max", "min"], "default": "mean",
                                         "help": "ViT rollout: how the heads of a layer are fused (default mean)"}),
    "discard_ratio": (("--discard-ratio",), {"type": float, "default": 0.0,
                                             "help": "ViT rollout: fraction of the weakest links dropped per layer"}),
    "beam": (("--beam",), {"type": at_least(1), "help": "captioner beam size (default: the checkpoint's)"}),
    "batch_size": (("--batch-size",), {"type": int, "default": 32, "help": "images per batch (default 32)"}),
}


def parser_for(name: str, description: str, *shared: str) -> argparse.ArgumentParser:
    """A ``vision-attn NAME`` parser with the ``SHARED_OPTIONS`` named in ``shared``."""
    parser = argparse.ArgumentParser(prog=f"vision-attn {name}", description=description)
    for option in shared:
        flags, settings = SHARED_OPTIONS[option]
        parser.add_argument(*flags, **settings)
    return parser
