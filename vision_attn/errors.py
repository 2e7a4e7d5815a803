"""User-facing errors, and turning them into one line and a non-zero exit instead of a traceback.

Every error a user can fix has its class here, so each layer raises it without importing another layer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message says which and why."""


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that is in none of the places we looked; the message lists them."""


class BadImageError(ValueError):
    """An image file that cannot be decoded; the message names the file."""


class Interrupted(Exception):
    """Ctrl-C during a command, after it kept what it had finished; the message says what and where."""


USER_ERRORS = (CheckpointError, DatasetNotFoundError, BadImageError, FileNotFoundError, FileExistsError, ValueError,
               FloatingPointError)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn the errors a user can fix (bad file, bad value, missing data, a diverged loss) into one line,
    ``error: ...``, and exit 2; Ctrl-C into one line saying what was kept, and exit 130. Set
    VISION_ATTN_TRACEBACK=1 to see the traceback instead."""
    try:
        yield
    except (KeyboardInterrupt, Interrupted) as error:
        if os.environ.get("VISION_ATTN_TRACEBACK"):
            raise
        print(str(error) or "interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except USER_ERRORS as error:
        if os.environ.get("VISION_ATTN_TRACEBACK"):
            raise
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from None
