"""Seconds a training step of the Fashion-MNIST default ViT takes here, and what its data path costs.

    python scripts/vit_step_time.py plain|stem|compile|loader

``plain``, ``stem`` (``stem: conv``) and ``compile`` (``compile: true``) time 40 steps of batch 256 after 3
warm-up steps (the warm-up time includes compiling), the model alone on random inputs; ``loader`` times one
pass over the training DataLoader alone. Run one at a time on an idle machine.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from vision_attn.datamodules import FashionMNISTDataModule
from vision_attn.tasks import ViTTask

ARCHITECTURE = dict(patch_size=4, embed_dim=96, depth=4, num_heads=4, mlp_ratio=2.0, global_pool="avg",
                    fused_attention=False)  # configs/vit/fashion_mnist.yaml when these were measured


def time_steps(variant: str, steps: int = 40) -> None:
    torch.manual_seed(0)
    model = ViTTask(image={"size": 28, "channels": 1}, training={"patch_drop_rate": 0.65}, compile=variant == "compile",
                    architecture={**ARCHITECTURE, "stem": "conv" if variant == "stem" else "patch"}).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
    model.train()

    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    start = time.perf_counter()
    for _ in range(3):
        step()
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    each = (time.perf_counter() - start) / steps
    print(f"{variant}: warm-up {warm_up:.1f} s, a step {each * 1000:.1f} ms, an epoch of 226 steps {226 * each:.1f} s")


def time_loader() -> None:
    data = FashionMNISTDataModule(val_size=2000, loader={"batch_size": 256}, augmentation={"hflip": True})
    data.setup("fit")
    start = time.perf_counter()
    batches = sum(1 for _ in data.train_dataloader())
    print(f"loader: {batches} batches in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("plain", "stem", "compile", "loader"):
        print("usage: python scripts/vit_step_time.py plain|stem|compile|loader", file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] == "loader":
        time_loader()
    else:
        time_steps(sys.argv[1])
