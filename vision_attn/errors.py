"""User-facing errors: a one-line message and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from vision_attn.checkpoint import CheckpointError
from vision_attn.data.fashion_mnist import DatasetNotFoundError
from vision_attn.data.images import BadImageError

USER_ERRORS = (CheckpointError, DatasetNotFoundError, BadImageError, FileNotFoundError, ValueError,
               FloatingPointError)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn the errors a user can fix (bad file, bad value, missing data, a diverged loss) into one line,
    ``error: ...``, and exit 2. Set VISION_ATTN_TRACEBACK=1 to see the traceback instead."""
    try:
        yield
    except USER_ERRORS as error:
        if os.environ.get("VISION_ATTN_TRACEBACK"):
            raise
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None
