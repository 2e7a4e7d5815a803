"""Writing result files so that a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
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
