"""Test-only Lightning callbacks, loaded by class path from the test configs (PYTHONPATH=repo root)."""

from __future__ import annotations

import time

import lightning as L


class SlowSteps(L.Callback):
    """Sleeps after each training step, so a test can kill the run at a chosen step. Timing only: the
    computation and the random streams are untouched."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: object, **kwargs: object) -> None:
        time.sleep(self.seconds)
