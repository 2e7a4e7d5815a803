"""The run's schedule: warm-up, cosine, and the time-budget variant of the learning rate."""

from __future__ import annotations

import math
from functools import partial

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
