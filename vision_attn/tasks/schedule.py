"""The one owner of a run's schedule: its progress and what follows it (the learning rate, phases that start
part-way, the PatchDropout rate, the stop at a time budget's last validation, a validation at a step budget's last
step). Progress is the share of steps done, or with ``Schedule.by_time`` and ``max_time`` the spent share of the
time budget if further (Li et al. 2020)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Timer

from vision_attn.option_groups import Schedule

log = logging.getLogger(__name__)


def budget_timer(trainer: L.Trainer) -> Timer | None:
    """Lightning's Timer when the trainer has a time budget (``max_time``), else None."""
    timer = next((callback for callback in trainer.callbacks if isinstance(callback, Timer)), None)
    return timer if timer is not None and timer.time_remaining("train") is not None else None


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                  time_share: float | None = None) -> float:
    """The learning rate as a share of the peak: (step + 1) / ``warmup_steps``, then min + (1 − min)·½(1 + cos(π·p)),
    p the share of the decay's steps done, or ``time_share`` when further."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if time_share is not None:
        progress = max(progress, min(1.0, time_share))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class RunSchedule(L.Callback):
    """The schedule of one run (``Schedule``); ``attach`` reads the trainer's steps and time budget.

    A validation that leaves less time than it took, within the budget's last ``tail``, ends the fit (else the
    Timer's stop would add steps and a second validation past the budget); one past ``max_time`` is left to it.
    """

    def __init__(self, options: Schedule | None = None, *, tail: float = 0.05) -> None:
        self.options, self.tail = Schedule.coerce(options), tail
        self.total_steps, self.warmup_steps = 1, 1
        self._trainer: L.Trainer | None = None
        self._timer: Timer | None = None
        self._phases: dict[str, int] = {}  # a phase that started part-way -> the step it started at
        self._validation_started: float | None = None

    def attach(self, trainer: L.Trainer) -> None:
        """Read the run's steps and time budget from ``trainer``, as the optimiser is set up."""
        self._trainer = trainer
        self.total_steps = max(1, int(trainer.estimated_stepping_batches))
        batches = trainer.num_training_batches
        if trainer.max_steps > 0 and self.total_steps == trainer.max_steps and math.isfinite(batches):
            steps_per_epoch = max(1.0, batches / trainer.accumulate_grad_batches)  # a step budget: an epoch's own
        else:
            steps_per_epoch = self.total_steps / max(1, trainer.max_epochs or 1)
        self.warmup_steps = max(1, round(self.options.warmup_epochs * steps_per_epoch))
        self._timer = budget_timer(trainer)
        if self.options.by_time and self._timer is None:
            log.warning("the schedule follows a time budget (schedule.by_time), but the trainer has no max_time: "
                        "it follows the steps")

    def time_share(self) -> float | None:
        """The share of the time budget spent (None without one, or when the schedule does not follow it)."""
        if not self.options.by_time or self._timer is None:
            return None
        elapsed, remaining = self._timer.time_elapsed("train"), self._timer.time_remaining("train")
        return elapsed / max(1e-9, elapsed + remaining)

    def progress(self) -> float:
        """The share of the run done, from 0 to 1: of its steps, or of its time budget when that is further on."""
        done = min(1.0, self._trainer.global_step / self.total_steps) if self._trainer is not None else 0.0
        spent = self.time_share()
        return done if spent is None else max(done, min(1.0, spent))

    def lr_factor(self, step: int) -> float:
        """The learning rate at optimiser step ``step`` as a share of the peak (``warmup_cosine``)."""
        return warmup_cosine(step, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                             min_lr_ratio=self.options.min_lr_ratio, time_share=self.time_share())

    def phase_started(self, name: str, *, epoch: int | None = None, share: float | None = None) -> bool:
        """Whether the phase ``name`` has started: from ``epoch``, or from the step at which ``share`` of the run was
        done (read on rank 0, so every rank switches at the same step)."""
        trainer = self._trainer
        if trainer is None:
            return False
        if epoch is not None and trainer.current_epoch >= epoch:
            return True
        if share is None:
            return False
        if name not in self._phases and trainer.strategy.broadcast(self.progress() >= share, src=0):
            self._phases[name] = trainer.global_step
            log.info("%.0f%% of the run done at step %d: %s from here", 100 * share, trainer.global_step, name)
        return name in self._phases and trainer.global_step >= self._phases[name]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """At a step budget's last step, ask Lightning to stop, which validates there: the final weights are always
        validated (and can be best.ckpt), whatever ``val_check_interval`` says and wherever the epoch ends."""
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Note when the validation starts, to time it."""
        self._validation_started = time.monotonic()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """End the fit when this validation left less of the time budget than it took, within its last ``tail``."""
        if trainer.sanity_checking or self._validation_started is None or trainer.state.fn != "fit":
            return
        took, self._validation_started = time.monotonic() - self._validation_started, None
        timer = budget_timer(trainer)
        if timer is None:  # no max_time (the same on every rank)
            return
        remaining = timer.time_remaining("train")
        budget = remaining + timer.time_elapsed("train")
        stop = 0 < remaining < min(took, self.tail * budget)  # past max_time, Lightning's own stop is next
        trainer.should_stop = trainer.should_stop or trainer.strategy.broadcast(stop)  # every rank as rank 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Say (and log ``stopped_by_max_time``) when ``max_time`` ended the fit before its steps or epochs."""
        timer = budget_timer(trainer)
        if timer is None or timer.time_remaining("train") > 0:
            return
        if trainer.max_steps > 0:
            short = trainer.global_step < trainer.max_steps
            budget = f"step {trainer.global_step} of its max_steps {trainer.max_steps}"
        else:
            short = trainer.max_epochs is not None and trainer.current_epoch < trainer.max_epochs
            budget = f"epoch {trainer.current_epoch} of its max_epochs {trainer.max_epochs}"
        if short:
            log.warning("trainer.max_time ended the fit at %s: the figures are those of a shorter run than the "
                        "config's", budget)
            if trainer.logger is not None:
                trainer.logger.log_metrics({"stopped_by_max_time": 1.0}, step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        """The steps at which the run's phases started (a resumed run stays in them)."""
        return {"phases": dict(self._phases)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the steps at which the run's phases started."""
        self._phases = dict(state_dict.get("phases", {}))
