"""The learning-rate schedule: warm-up, cosine, and the time-budget variant."""

from __future__ import annotations

import math

import pytest
import torch

from vision_attn.schedule import warmup_cosine


def factors(schedule, steps: int) -> list[float]:
    values = []
    for _ in range(steps):
        values.append(schedule.get_last_lr()[0])
        schedule.optimizer.step()
        schedule.step()
    return values


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_warmup_then_cosine_to_the_floor() -> None:
    values = factors(warmup_cosine(optimizer(), warmup_steps=2, total_steps=6, min_lr_ratio=0.1), 7)
    assert values[:2] == [0.5, 1.0]
    assert values[2] == pytest.approx(1.0)  # progress 0 of 4 decay steps
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[6] == pytest.approx(0.1)


def test_the_time_budget_moves_the_decay_on_when_time_runs_ahead_of_the_steps() -> None:
    used = {"fraction": 0.0}
    schedule = warmup_cosine(optimizer(), warmup_steps=1, total_steps=1001, time_progress=lambda: used["fraction"])
    factors(schedule, 2)
    used["fraction"] = 0.5  # half the time gone after 1 of 1000 decay steps: time leads
    schedule.optimizer.step()
    schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(0.5)
    used["fraction"] = 1.2  # past the cap: the floor, never below
    schedule.optimizer.step()
    schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(0.0)
