"""What a checkpoint must be before any of it is used, seen by ``checkpoint.load_file``: the zip archive that
``torch.save`` writes passes every member's CRC check (torch reads the bytes without checking them), its weights
are finite, and the fields vision-attn writes about the checkpoint itself have the types it writes.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# The top-level fields vision-attn and Lightning write, with the type each must have when present
# (``checkpoint.KIND_KEY`` and ``VERSION_KEY`` among them, spelled out here so that this module imports nothing).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "vision_attn_kind": (str,), "vision_attn_version": (str,), "vision_attn_rng": (Mapping,),
    "hyper_parameters": (Mapping,), "state_dict": (Mapping,), "epoch": (int,), "global_step": (int,),
}
TYPE_NAMES = {str: "a string", Mapping: "a mapping", int: "a whole number", list: "a list"}
# Hyper-parameters every task reads as they are, before its option groups check the rest
HPARAM_TYPES: dict[str, tuple[type, ...]] = {"vocabulary": (list, tuple), "class_names": (list, tuple),
                                             "colour_names": (list, tuple)}
# Where the weights sit in a file: a Lightning checkpoint's state_dict, or a wrapper, else the file's top level
WEIGHT_KEYS = ("state_dict", "model", "model_state_dict", "module")


def zip_damage(path: Path) -> str | None:
    """Which member of the zip archive at ``path`` fails its CRC check (None: each member's bytes match its CRC,
    or the archive cannot be opened at all, which ``checkpoint_files.inspect_torch_file`` words once torch fails).
    Each member is read in chunks (``ZipFile.testzip``): at most one chunk is in memory, whatever the file's size."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError):
        return None
    except (OSError, ValueError, NotImplementedError) as error:  # a member's header or compression is damaged
        return f"its zip archive cannot be read ({type(error).__name__})"
    return f"its member {damaged} fails its CRC check" if damaged else None


def weights_of(loaded: Mapping[str, Any]) -> Mapping[str, Any]:
    """The weights inside a loaded checkpoint or weights file (``WEIGHT_KEYS``), else the file itself."""
    for key in WEIGHT_KEYS:
        inner = loaded.get(key)
        if isinstance(inner, Mapping):
            return inner
    return loaded


def first_non_finite(loaded: Mapping[str, Any]) -> str | None:
    """The name of the first floating-point weight that holds NaN or an infinity (None: all finite). Only the
    weights are looked at: a Lightning checkpoint's callback states hold infinities by design (a ModelCheckpoint's
    ``kth_value`` starts at ±inf)."""
    for name, value in weights_of(loaded).items():
        if isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex()) and \
                not bool(value.isfinite().all()):
            return str(name)
    return None


def metadata_problem(loaded: Mapping[str, Any]) -> str | None:
    """What is wrong with the types of a checkpoint's own fields (``FIELD_TYPES``, and the hyper-parameters of
    ``HPARAM_TYPES``), naming the first field of the wrong type; None when each has its type."""
    for key, types in FIELD_TYPES.items():
        if key in loaded and (not isinstance(loaded[key], types) or isinstance(loaded[key], bool)):
            return _wrong_type(key, loaded[key], types)
    state = loaded.get("state_dict")
    for name, value in (state or {}).items():
        if not isinstance(name, str) or not isinstance(value, Tensor):
            return f"its field state_dict holds {_name(value)} under {str(name)[:80]!r}, where weights are tensors"
    hparams = loaded.get("hyper_parameters") or {}
    for key, types in HPARAM_TYPES.items():
        value = hparams.get(key)
        if value is not None and not isinstance(value, types):
            return _wrong_type(f"hyper_parameters.{key}", value, types)
        if value is not None and not all(isinstance(item, str) for item in value):
            return f"its field hyper_parameters.{key} must be a list of strings"
    rng = loaded.get("vision_attn_rng") or {}
    if "torch" in rng and not (isinstance(rng["torch"], Tensor) and rng["torch"].dtype == torch.uint8):
        return "its field vision_attn_rng.torch must be a tensor of bytes"
    python = rng.get("python")
    if python is not None and not (isinstance(python, list | tuple) and len(python) == 3 and
                                   isinstance(python[1], list | tuple)):
        return "its field vision_attn_rng.python must be Python's random state (version, state, gauss)"
    return None


def _name(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _wrong_type(field: str, value: Any, types: tuple[type, ...]) -> str:
    wanted = TYPE_NAMES.get(types[0], types[0].__name__)
    return f"its field {field} must be {wanted}, found {_name(value)}"
