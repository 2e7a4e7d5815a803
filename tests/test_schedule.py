"""The run's schedule: warm-up, cosine, and the time-budget variant of the learning rate."""

from __future__ import annotations

import math
from functools import partial

import lightning as L
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from vision_attn.option_groups import Schedule
from vision_attn.tasks.schedule import RunSchedule, warmup_cosine


def factors(schedule: LambdaLR, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        values.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return values


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_warmup_then_cosine_to_the_floor() -> None:
    schedule = RunSchedule(Schedule(min_lr_ratio=0.1))
    schedule.total_steps, schedule.warmup_steps = 6, 2  # what ``attach`` reads off a trainer
    values = factors(LambdaLR(optimizer(), schedule.lr_factor), 7)
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0)  # progress 0 of 4 decay steps
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[6] == pytest.approx(0.1)


def test_the_time_budget_moves_the_decay_on_when_time_runs_ahead_of_the_steps() -> None:
    factor = partial(warmup_cosine, warmup_steps=1, total_steps=1001)
    assert factor(1) == pytest.approx(1.0)  # step 1 of 1000 decay steps, no time budget
    assert factor(1, time_share=0.5) == pytest.approx(0.5)  # half the time gone: time leads
    assert factor(1, time_share=1.2) == pytest.approx(0.0)  # past the cap: the floor, never below
    assert factor(900, time_share=0.1) == pytest.approx(factor(900))  # the steps lead: they set the rate


def test_a_schedule_without_a_trainer_has_no_progress_and_no_phase() -> None:
    schedule = RunSchedule(Schedule(by_time=True))
    assert schedule.progress() == 0.0 and schedule.time_share() is None
    assert not schedule.phase_started("self-critical training", epoch=0, share=0.0)
    assert schedule.state_dict() == {"phases": {}}


class _Steps(L.LightningModule):
    """A model whose every step takes ``pause`` seconds; its optimiser's schedule is a ``RunSchedule``."""

    def __init__(self, schedule: RunSchedule, pause: float = 0.0) -> None:
        super().__init__()
        self.layer, self.schedule, self.pause = torch.nn.Linear(1, 1), schedule, pause

    def training_step(self, batch, batch_idx):
        import time

        time.sleep(self.pause)
        return self.layer(batch[0]).sum()

    def configure_callbacks(self):
        return [self.schedule]  # as the tasks bring theirs

    def configure_optimizers(self):
        self.schedule.attach(self.trainer)
        optim = torch.optim.SGD(self.parameters(), lr=1.0)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": LambdaLR(optim, self.schedule.lr_factor),
                                                     "interval": "step"}}


def _loader(batches: int):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.zeros(batches, 1)), batch_size=1)


def test_under_a_step_budget_the_warm_up_counts_an_epochs_own_steps(tmp_path) -> None:
    """max_steps 25 over epochs of 10 steps, warm-up 0.5 epoch: 5 steps (not 25 / max_epochs)."""
    schedule = RunSchedule(Schedule(warmup_epochs=0.5))
    trainer = L.Trainer(max_steps=25, max_epochs=100, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(_Steps(schedule), _loader(10))
    assert trainer.global_step == 25 and schedule.total_steps == 25 and schedule.warmup_steps == 5


class _Validated(_Steps):
    """``_Steps`` that notes the global step of each validation."""

    def __init__(self, schedule: RunSchedule) -> None:
        super().__init__(schedule)
        self.validated_at: list[int] = []

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.validated_at.append(self.trainer.global_step)


@pytest.mark.parametrize(("max_steps", "interval", "expected"), [
    (7, 1.0, [7]),  # inside the first epoch of 10: validated only where the budget ends
    (25, 1.0, [10, 20, 25]),  # each epoch's end, then the budget's last step, part-way through an epoch
    (20, 1.0, [10, 20]),  # the budget ends with an epoch: one validation there, not two
    (12, 4, [4, 8, 12]),  # every 4 steps, the last of them the budget's
])
def test_a_step_budget_validates_its_last_step(tmp_path, max_steps, interval, expected) -> None:
    """Whatever val_check_interval says, the weights a step budget ends with are validated, once."""
    model = _Validated(RunSchedule(Schedule()))
    trainer = L.Trainer(max_steps=max_steps, max_epochs=100, val_check_interval=interval, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)
    trainer.fit(model, _loader(10), _loader(2))
    assert trainer.global_step == max_steps and model.validated_at == expected


def test_a_max_time_ceiling_that_ends_a_step_budget_says_so(tmp_path, caplog) -> None:
    """max_steps 1000 of 0.2-s steps under a 1-s max_time: the fit ends early, says so in one line, and logs
    stopped_by_max_time; a fit that reaches its max_steps says nothing."""
    import logging
    from datetime import timedelta

    from lightning.pytorch.loggers import CSVLogger

    def fit(steps: int, pause: float) -> L.Trainer:
        trainer = L.Trainer(max_steps=steps, max_epochs=1000, max_time=timedelta(seconds=1), enable_progress_bar=False,
                            logger=CSVLogger(tmp_path, name=f"run{steps}"), enable_checkpointing=False,
                            enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(_Steps(RunSchedule(Schedule()), pause), _loader(5))
        return trainer

    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.schedule"):
        stopped = fit(1000, 0.2)
    assert stopped.global_step < 1000
    said = [r.getMessage() for r in caplog.records if "max_time ended the fit" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0] and f"step {stopped.global_step} of its max_steps 1000" in said[0]
    assert "stopped_by_max_time" in next(tmp_path.glob("run1000/*/metrics.csv")).read_text()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.schedule"):
        fit(3, 0.0)
    assert not [r for r in caplog.records if "max_time ended the fit" in r.getMessage()]


def test_a_max_time_ceiling_that_ends_an_epoch_budget_says_so(tmp_path, caplog) -> None:
    """max_epochs 200 of five 0.2-s steps under a 1-s max_time: the fit ends in an early epoch and says which; a fit
    that reaches its max_epochs says nothing."""
    import logging
    from datetime import timedelta

    def fit(epochs: int, pause: float) -> L.Trainer:
        trainer = L.Trainer(max_epochs=epochs, max_time=timedelta(seconds=1), enable_progress_bar=False, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
        trainer.fit(_Steps(RunSchedule(Schedule()), pause), _loader(5))
        return trainer

    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.schedule"):
        stopped = fit(200, 0.2)
    said = [r.getMessage() for r in caplog.records if "max_time ended the fit" in r.getMessage()]
    assert stopped.current_epoch < 200
    assert len(said) == 1 and f"epoch {stopped.current_epoch} of its max_epochs 200" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.schedule"):
        fit(2, 0.0)
    assert not [r for r in caplog.records if "max_time ended the fit" in r.getMessage()]
