"""Writing result files so that a crash never leaves a half-written file under the final name."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomically(path: str | os.PathLike, payload: Any) -> Path:
    """Write JSON to a temporary file beside ``path``, then rename it into place (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as file:
        try:
            json.dump(payload, file)
        except BaseException:
            file.close()
            os.unlink(file.name)
            raise
        temporary = Path(file.name)
    temporary.replace(path)
    return path
