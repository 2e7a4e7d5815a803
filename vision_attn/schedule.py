"""Learning-rate schedule and parameter groups shared by the LightningModules."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(optimizer: Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                  time_progress: Callable[[], float] | None = None) -> LambdaLR:
    """Linear warm-up to the base rate over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` × base.

    With ``time_progress`` (the fraction of a time budget used, 0 to 1) the decay follows whichever is further
    along, steps or time: a run capped by time then ends its schedule at the cap however fast the machine is
    (budgeted training, Li et al. 2020).
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if time_progress is not None:
            progress = max(progress, min(1.0, time_progress()))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def decay_groups(model: nn.Module, weight_decay: float, skip: set[str] = frozenset()) -> list[dict]:
    """Weight decay on matrices only; biases, norms and the names in ``skip`` are left undecayed."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim < 2 or name in skip else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
