"""The command line's option types and the options several tools share: parsed and range-checked at the edge,
so a bad value is one argparse line before any work is done."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NoReturn


def at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low`` (and at most ``high``)."""
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low or (high is not None and int(text) > high):
            bound = "" if high is None else f" and at most {high}"
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}{bound}, got {text!r}")
        return int(text)
    return parse


def bounded_int(low: int, high: int, why: str) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``; above ``high`` the refusal says ``why``."""
    def parse(text: str) -> int:
        if not text.strip().lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"expected a whole number from {low} to {high}, got {text!r}")
        if int(text) > high:
            raise argparse.ArgumentTypeError(f"at most {high}, got {text.strip()} ({why})")
        return int(text)
    return parse


def number_in(low: float, high: float = math.inf, *, high_included: bool = True,
              why: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number from ``low`` to ``high``; ``why``, when given, says why it is bounded."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value and (value <= high if high_included else value < high)):
            bound = "" if high == math.inf else f"{'at most' if high_included else 'below'} {high:g}"
            if why and math.isfinite(value) and value >= high:
                raise argparse.ArgumentTypeError(f"{bound}, got {text.strip()} ({why})")
            raise argparse.ArgumentTypeError(f"expected a number of at least {low:g}{' and ' * bool(bound)}{bound}, "
                                             f"got {text!r}")
        return value
    return parse


# The bounds of the sizes, counts and beams the tools share: each serves real use with room to spare, and keeps a
# typo (an extra zero or three) from taking all the memory, time or disk there is.
BATCH_SIZE = bounded_int(1, 1024, "a larger batch only costs memory: inference is no faster past a few dozen")
BEAM_SIZE = bounded_int(1, 50, "captions stop improving long before; each beam costs time and memory, and "
                                 "--all-beams JSON grows with it")


def device(text: str) -> str:
    """An argparse type: a torch device that this machine has (``cpu``, ``cuda``, ``cuda:1``, ``mps``)."""
    import torch
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (try cpu, cuda, cuda:0 or mps)") from None
    if parsed.type == "cuda" and not (torch.cuda.is_available() and (parsed.index or 0) < torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no MPS device")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu, cuda and mps devices are supported here")
    return text


# data.backgrounds.BACKGROUNDS, named here too: the options come before the data layer
BACKGROUND_KINDS = ["black", "noise", "texture", "distractors", "mixed"]
SHARED_OPTIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {  # options several tools take, by name
    "device": (("--device",), {"type": device, "default": "cpu", "help": "torch device (default cpu)"}),
    "bad_images": (("--on-bad-image",), {"choices": ["error", "skip"], "default": "error",
                                         "help": "an unreadable image stops the run (default) or is skipped"}),
    "head_fusion": (("--head-fusion",), {"choices": ["mean", "max", "min"], "default": "mean",
                                         "help": "ViT rollout: how the heads of a layer are fused (default mean)"}),
    "discard_ratio": (("--discard-ratio",), {"type": number_in(0.0, 1.0, high_included=False), "default": 0.0,
                                             "help": "ViT rollout: fraction of the weakest links dropped per layer"}),
    "beam": (("--beam",), {"type": BEAM_SIZE, "help": "captioner beam size, 1 to 50 (default: the checkpoint's)"}),
    "batch_size": (("--batch-size",), {"type": BATCH_SIZE, "default": 32,
                                       "help": "images per batch, 1 to 1024 (default 32)"}),
    "canvas_background": (("--background",), {
        "choices": BACKGROUND_KINDS, "default": "black",
        "help": "what the canvas under each item is (the scenes' backgrounds, docs/formats/scenes.md): black "
                "(default), noise, texture, distractors or mixed; the item's mask stays its own pixels"}),
    "background_level": (("--background-level",), {"type": number_in(0, 1), "default": 0.5,
                                                   "help": "the brightest a background is drawn, 0 to 1 of white "
                                                           "(default 0.5)"}),
    "texture_source": (("--texture-source",), {"choices": ["skimage", "matplotlib"], "default": "skimage",
                                               "help": "the photographs of texture backgrounds: scikit-image's or "
                                                       "matplotlib's sample images (default skimage)"}),
    "overwrite": (("--overwrite",), {"action": "store_true",
                                     "help": "write into a folder that holds files this command did not write: "
                                             "files of the names it writes are replaced, every other file is kept "
                                             "(without it such a folder is refused; a folder this command wrote "
                                             "before is always rewritten, its old files removed)"}),
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``error: <what>: <why>``, and exit 2, as every other error."""

    def error(self, message: str) -> NoReturn:
        """Exit 2 with ``message`` on one line, pointing to ``--help``."""
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def parser_for(name: str, description: str, *shared: str) -> argparse.ArgumentParser:
    """A ``vision-attn NAME`` parser with the ``SHARED_OPTIONS`` named in ``shared``."""
    parser = OneLineParser(prog=f"vision-attn {name}", description=description)
    add_shared(parser, *shared)
    return parser


def add_shared(parser: argparse.ArgumentParser, *shared: str) -> None:
    """Add the ``SHARED_OPTIONS`` named in ``shared`` to ``parser``."""
    for option in shared:
        flags, settings = SHARED_OPTIONS[option]
        parser.add_argument(*flags, **settings)


_GROUP_OPTION = re.compile(r"--((?:model|data)(?:\.init_args)?\.\w+)\.(\w+)")
_NULLS = ("null", "Null", "NULL", "~")


def nulls_to_groups(args: Sequence[str]) -> list[str]:
    """``--model.init_args.<group>.<option> null`` (or ``=null``, and under ``data``) as ``--model.init_args.<group>
    {"<option>": null}``: the jsonargparse this project pins hands the first to a group nested in a subclass's
    arguments as the string 'None', the second as null, merged over the group's other options."""
    rewritten: list[str] = []
    index = 0
    while index < len(args):
        key, equals, value = args[index].partition("=")
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        match = _GROUP_OPTION.fullmatch(key)
        if match and value in _NULLS:
            rewritten += [f"--{match.group(1)}", json.dumps({match.group(2): None})]
            index += 1 if equals else 2
        else:
            rewritten.append(args[index])
            index += 1
    return rewritten
