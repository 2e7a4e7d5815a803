"""Writing result files so that a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


def replace_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, then rename it into place (atomic on POSIX).

    If ``write`` fails the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as file:
        try:
            write(file)
        except BaseException:
            file.close()
            os.unlink(file.name)
            raise
        temporary = Path(file.name)
    umask = os.umask(0)
    os.umask(umask)
    temporary.chmod(0o666 & ~umask)  # a normal file's permissions, not the temporary file's 0600
    temporary.replace(path)
    return path


def write_json_atomically(path: str | os.PathLike, payload: Any) -> Path:
    """Write JSON to ``path`` atomically."""
    return replace_atomically(path, lambda file: file.write(json.dumps(payload).encode("utf-8")))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_parents(path: Path) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{path}: cannot be written, {parent} is a file, not a folder")
            return


def output_file(path: str | os.PathLike, *, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """A file a command will write, checked before any work: not an existing folder, not under a file, and not
    one of the command's ``inputs`` (which writing would destroy)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; give the name of a file to write")
    _check_parents(path)
    if any(_same_file(path, Path(item)) for item in inputs):
        raise ValueError(f"{path}: is one of the inputs; writing it would overwrite it (choose another output)")
    return path


def output_folder(path: str | os.PathLike) -> Path:
    """A folder a command will write into, checked before any work: not an existing file, not under a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: is a file, not a folder to write into")
    _check_parents(path)
    return path


def input_file(path: str | os.PathLike, what: str, *, error: type[Exception] = ValueError) -> Path:
    """A file a command reads, checked before it is opened: not a folder, not a pipe or a device (opening a
    pipe would block), and there. ``what`` names it in the one-line errors ("a results JSON")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a folder, not {what}")
    if path.exists() and not path.is_file():
        raise error(f"{path}: not a regular file (a pipe or a device?), so not {what}")
    if not path.is_file():
        raise (FileNotFoundError if error is ValueError else error)(f"{path}: no such file ({what} was expected)")
    return path
