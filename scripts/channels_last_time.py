"""The small CNN's training step (forward and backward) in the default layout and in channels_last, one thread.

    python scripts/channels_last_time.py [--threads 1] [--width 24]

Two shapes: the scenes captioner's batch (32 scenes at 96 px) and the encoder pretraining's (128 items at 32 px).
Prints the median of 10 timed steps after 2 warm-up steps, in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vision_attn.captioning.encoder import SmallCNN


def step_ms(width: int, batch: int, size: int, channels_last: bool, steps: int = 10) -> float:
    torch.manual_seed(0)
    net, images = SmallCNN(width), torch.randn(batch, 3, size, size)
    if channels_last:
        net, images = net.to(memory_format=torch.channels_last), images.contiguous(memory_format=torch.channels_last)
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        net(images).square().mean().backward()
        if step >= 2:
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--width", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, batch, size in (("captioner, 32 scenes at 96 px", 32, 96), ("pretraining, 128 items at 32 px", 128, 32)):
        plain, fast = (step_ms(args.width, batch, size, layout) for layout in (False, True))
        print(f"{name}: {plain:.1f} ms default, {fast:.1f} ms channels_last ({plain / fast:.2f}x)")


if __name__ == "__main__":
    main()
