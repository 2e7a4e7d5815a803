"""What a checkpoint must be before any of it is used (``checkpoint.load_file``), and what is wrong with a file that
``torch.load`` could not read, all seen without running anything in it: the zip archive that ``torch.save`` writes
passes every member's CRC check (torch does not check them), lists its members and holds a ``data.pkl``; its pickle
(or the legacy format's) is whole opcodes naming only torch's globals; its weights are finite, and the fields
vision-attn writes about the checkpoint itself have the types it writes.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from collections import deque
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
LEGACY_PICKLES = 5  # torch's legacy format: magic number, protocol, system info, the object, its storages' keys
# Opcodes that push a string (a global's module or name, for STACK_GLOBAL), those that push an item of the memo,
# and those that only store the top of the stack in the memo (they push nothing)
_STRING_OPCODES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                   "STRING"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_MEMO_STORES = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def zip_damage(path: Path) -> str | None:
    """Which member of the zip archive at ``path`` fails its CRC check (None also when it is no archive, which
    ``inspect_torch_file`` words once torch fails). ``ZipFile.testzip`` holds one chunk at a time in memory."""
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
    return next((loaded[key] for key in WEIGHT_KEYS if isinstance(loaded.get(key), Mapping)), loaded)


def first_non_finite(loaded: Mapping[str, Any]) -> str | None:
    """The name of the first floating-point weight that holds NaN or an infinity. Only the weights are looked at:
    a ModelCheckpoint's state holds ±inf by design."""
    return next((str(name) for name, value in weights_of(loaded).items() if isinstance(value, Tensor) and
                 (value.is_floating_point() or value.is_complex()) and not bool(value.isfinite().all())), None)


def metadata_problem(loaded: Mapping[str, Any]) -> str | None:
    """The first of a checkpoint's own fields (``FIELD_TYPES``, the hyper-parameters of ``HPARAM_TYPES``, the
    weights and the random state) that has the wrong type, in words; None when each has its type."""
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


def inspect_torch_file(path: Path) -> tuple[str | None, str | None]:
    """(what is damaged, the first global its pickle names that is not torch's), each None when none is seen: a
    zip archive must list its members and hold a ``data.pkl``, whose pickle (or the legacy format's pickles) must be
    whole opcodes up to its end."""
    with open(path, "rb") as file:
        if file.read(2) != b"PK":  # a pickle: torch's legacy format (pickles, then the tensors' bytes), or one
            file.seek(0)
            foreign = None
            for _ in range(LEGACY_PICKLES):
                damage, found = scan_pickle(file)
                foreign = foreign or found
                if damage or not file.read(1):
                    return damage, foreign
                file.seek(-1, os.SEEK_CUR)
            return None, foreign
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.rpartition("/")[2] == "data.pkl"]
            if not pickles:
                return "a zip archive without the data.pkl of a PyTorch checkpoint", None
            with archive.open(pickles[0]) as pickled:
                return scan_pickle(pickled)
    except (zipfile.BadZipFile, EOFError):
        return "an incomplete zip archive: the list of its members at its end is missing", None


def scan_pickle(stream: Any) -> tuple[str | None, str | None]:
    """(what is damaged, the first global named outside torch) of the pickle read from the binary ``stream``, by
    its opcodes (``pickletools.genops`` runs nothing). Torch's globals: ``torch`` and its modules,
    ``collections.OrderedDict`` and ``torch.serialization.get_safe_globals()``."""
    allowed = {item[1] if isinstance(item, tuple) else f"{getattr(item, '__module__', '')}."
               f"{getattr(item, '__qualname__', '')}" for item in torch.serialization.get_safe_globals()}
    allowed.add("collections.OrderedDict")
    pushed: deque[str | None] = deque(maxlen=2)  # what the last opcodes pushed: a string, or None for anything else
    memo: dict[int, str | None] = {}
    foreign = None
    start = stream.tell()
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            name = opcode.name
            if name in _MEMO_STORES:
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = pushed[-1] if pushed else None
            elif name in ("GLOBAL", "INST", "STACK_GLOBAL"):
                module, attribute = [None, None, *pushed][-2:] if name == "STACK_GLOBAL" else str(arg).split(" ", 1)
                if foreign is None and module is not None and str(module).partition(".")[0] != "torch" and \
                        f"{module}.{attribute}" not in allowed:
                    foreign = f"{module}.{attribute}"
                pushed.append(None)
            elif opcode.stack_after:
                pushed.append(str(arg) if name in _STRING_OPCODES else memo.get(int(arg)) if name in _MEMO_GETS
                              else None)
    except ValueError:  # an unknown opcode, or the end of the stream before the pickle's STOP
        offset = stream.tell() - start
        return ("its pickle ends early" if not stream.read(1) else f"byte {offset - 1} of its pickle is no pickle "
                "opcode"), foreign
    return None, foreign
