"""What is wrong with a PyTorch checkpoint file that ``torch.load`` could not read, seen without running anything in
it: the zip archive ``torch.save`` writes (its list of members and its ``data.pkl``, with ``zipfile``; its CRCs
are checked before torch reads it, by ``checkpoint_checks``), and the pickle in it or of the legacy format (whole
opcodes up to its end, and the globals it names, with ``pickletools``). ``checkpoint.unreadable_reason`` words it
for the user.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch

LEGACY_PICKLES = 5  # torch's legacy format: magic number, protocol, system info, the object, its storages' keys
# Opcodes that push a string (a global's module or name, for STACK_GLOBAL), and those that only store the top
# of the stack in the memo (they push nothing)
_STRING_OPCODES = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                   "STRING"}
_MEMO_STORES = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def inspect_torch_file(path: Path) -> tuple[str | None, str | None]:
    """(what is damaged, the first global its pickle names that is not torch's), each None when there is none
    seen: the zip archive of ``torch.save`` must list its members and hold a ``data.pkl``; the
    pickle (``data.pkl``, or the whole file in the legacy format) must be whole opcodes up to its end."""
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
    """(what is damaged, the first global named outside torch) of the pickle read from the binary ``stream``,
    by its opcodes (``pickletools.genops``, which runs nothing). A global is torch's when its module is ``torch``
    or under it, ``collections.OrderedDict``, or one of ``torch.serialization.get_safe_globals()``."""
    allowed = {item[1] if isinstance(item, tuple) else f"{getattr(item, '__module__', '')}."
               f"{getattr(item, '__qualname__', '')}" for item in torch.serialization.get_safe_globals()}
    allowed.add("collections.OrderedDict")
    pushed: list[str | None] = []  # what each opcode pushed: a string, or None for anything else
    memo: dict[int, str | None] = {}
    foreign = None
    start = stream.tell()
    try:
        for opcode, arg, _ in pickletools.genops(stream):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, attribute = str(arg).partition(" ")
            elif name == "STACK_GLOBAL":
                module, attribute = (pushed[-2:] if len(pushed) >= 2 else [None, None])
            elif name in _MEMO_STORES:
                memo[len(memo) if name == "MEMOIZE" else int(arg)] = pushed[-1] if pushed else None
                continue
            else:
                if name in _STRING_OPCODES:
                    pushed.append(str(arg))
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed.append(memo.get(int(arg)))
                elif opcode.stack_after:
                    pushed.append(None)
                continue
            qualified = f"{module}.{attribute}"
            if foreign is None and module is not None and not (
                    module == "torch" or str(module).startswith("torch.") or qualified in allowed):
                foreign = qualified
            pushed.append(None)
    except ValueError:  # an unknown opcode, or the end of the stream before the pickle's STOP
        offset = stream.tell() - start
        return ("its pickle ends early" if not stream.read(1) else f"byte {offset - 1} of its pickle is no pickle "
                "opcode"), foreign
    return None, foreign
