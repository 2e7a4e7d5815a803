"""User-facing errors, and turning them into one line and a non-zero exit instead of a traceback. Every error a user
can fix has its class here, so each layer raises it without importing another layer."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message says which and why."""


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that is in none of the places we looked; the message lists them."""


class BadImageError(ValueError):
    """An image file that cannot be decoded; the message names the file."""


class Interrupted(Exception):
    """Ctrl-C during a command, after it kept what it had finished; the message says what and where."""


USER_ERRORS = (FileNotFoundError, FileExistsError, ValueError, FloatingPointError)  # the classes above subclass these


def _raised_by_us(error: BaseException) -> bool:
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and f"{os.sep}vision_attn{os.sep}" in traceback.tb_frame.f_code.co_filename


WORKER_TRACEBACK = "Original Traceback (most recent call last):"  # how a DataLoader worker's error arrives


def user_message(error: BaseException) -> str:
    """The one line to show: the error, or ours that a library wrapped (jsonargparse's Union dump), followed through
    ``__cause__`` and unsuppressed ``__context__``; of a DataLoader worker's, its traceback's last line."""
    seen, cause = set(), error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if cause is not error and isinstance(cause, USER_ERRORS) and _raised_by_us(cause):
            error = cause
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    text = str(error)
    if WORKER_TRACEBACK in text:
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = last.partition(": ")[2] or last
    return printable(" ".join(text.split()))  # one line


def printable(text: str, keep: str = "") -> str:
    """``text`` with each non-printable character but those in ``keep`` shown escaped (``\\x1b``, ``\\u202e``): a
    file's name may hold a terminal escape or a bidi override, and none reaches the terminal."""
    return "".join(char if char.isprintable() or char in keep else ascii(char)[1:-1] for char in text)


class EscapedFormatter(logging.Formatter):
    """A log formatter whose lines show ``printable`` text: a logged skip names the user's file as an error does."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as ``logging.Formatter`` writes it, non-printable characters but new lines and tabs escaped."""
        return printable(super().format(record), keep="\n\t")


class EscapedOutput:
    """A text stream that writes to ``stream`` what ``printable`` shows, new lines, returns and tabs kept."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        """Write ``text`` escaped; the count of characters given, as a stream returns."""
        self.stream.write(printable(text, keep="\n\r\t"))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """The errors a user can fix as one line, ``error: ...``, and exit 2; Ctrl-C as one line saying what was kept,
    and exit 130. VISION_ATTN_TRACEBACK=1 shows the traceback instead."""
    try:
        yield
    except (KeyboardInterrupt, Interrupted, *USER_ERRORS) as error:
        if os.environ.get("VISION_ATTN_TRACEBACK"):
            raise
        interrupted = isinstance(error, KeyboardInterrupt | Interrupted)
        print((str(error) or "interrupted") if interrupted else f"error: {user_message(error)}", file=sys.stderr)
        raise SystemExit(130 if interrupted else 2) from None
