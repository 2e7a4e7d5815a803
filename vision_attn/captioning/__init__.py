"""Show, Attend and Tell: annotation encoder, attention decoder, beam search, LightningModule, vocabulary."""

from __future__ import annotations

from typing import Any

__all__ = ["ShowAttendTell"]


def __getattr__(name: str) -> Any:
    # Lazy, so `vision_attn.captioning.vocabulary` (used by the metrics) does not pull in Lightning and the
    # LightningModule, which itself imports the metrics.
    if name == "ShowAttendTell":
        from vision_attn.captioning.module import ShowAttendTell

        return ShowAttendTell
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
