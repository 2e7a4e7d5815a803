"""What the benchmarks feed the models and how a timed train step ends: random captions of spread lengths, and the
backward and optimiser step with or without a gradient scaler."""

from __future__ import annotations

import torch
from torch import Tensor

from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID


def random_captions(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(B, length + 2) ids <start> w.. <end> <pad>.. with lengths spread from length/2 to length words, and each
    caption's length in tokens."""
    words = torch.randint(4, vocab_size, (batch, length), generator=generator)
    counts = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    captions = torch.full((batch, length + 2), PAD_ID)
    captions[:, 0] = START_ID
    for row, count in enumerate(counts.tolist()):
        captions[row, 1 : count + 1] = words[row, :count]
        captions[row, count + 1] = END_ID
    return captions, counts + 2


def backward_and_step(loss: Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """Zero the gradients, backward and step, through ``scaler`` when there is one (16-mixed)."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
