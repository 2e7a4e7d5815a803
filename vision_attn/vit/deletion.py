"""Deletion curves (``docs/formats/metrics.md``): the probability of the predicted class as a map's top k patches
are erased, k = 0 .. N; a map pointing at the evidence has a lower area under it than a random order."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from vision_attn.data.backgrounds import Background, TestCanvasFill
from vision_attn.data.classification_datasets import eval_transform
from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
from vision_attn.data.images import normalize
from vision_attn.vit.classifier import Classifier
from vision_attn.vit.rollout import HeadFusion, explain
from vision_attn.vit.rollout_mass import canvas_batches, named_maps

# images (B, C, H, W) as the model takes them -> class probabilities (B, classes)
Probabilities = Callable[[Tensor], Tensor]
DELETION_MAPS = ("rollout", "gradient rollout", "last layer", "random")


def erase_steps(patches: int, steps: int) -> list[int]:
    """The patch counts erased, k_j = round(j·N / S) for j = 0 .. S, with S = min(``steps``, N)."""
    if patches < 1 or steps < 1:
        raise ValueError(f"a deletion curve needs at least one patch and one step, got {patches} and {steps}")
    steps = min(steps, patches)
    return [round(j * patches / steps) for j in range(steps + 1)]


def patch_masks(order: Tensor, erased: int, grid: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """(B, 1, H, W): the pixels of the first ``erased`` patches of each ``order`` (B, N) over a Gh×Gw grid."""
    batch, patches = order.shape
    chosen = torch.zeros(batch, patches, dtype=torch.bool, device=order.device)
    chosen.scatter_(1, order[:, :erased], True)
    cells = chosen.view(batch, 1, *grid)
    return cells.repeat_interleave(size[0] // grid[0], 2).repeat_interleave(size[1] // grid[1], 3)


def deletion_curves(probabilities: Probabilities, images: Tensor, backgrounds: Tensor, maps: Mapping[str, Tensor], *,
                    steps: int) -> tuple[list[int], dict[str, Tensor]]:
    """The erased counts (``erase_steps``) and per map (B, Gh, Gw) each image's curve (B, S + 1): the predicted
    class's probability with the top k patches taken from ``backgrounds`` (ties keep the patches' order)."""
    grid = next(iter(maps.values())).shape[-2:]
    if images.shape[-2] % grid[0] or images.shape[-1] % grid[1]:
        raise ValueError(f"{tuple(images.shape[-2:])} images do not tile a {tuple(grid)} patch grid")
    counts = erase_steps(grid[0] * grid[1], steps)
    with torch.no_grad():
        first = probabilities(images)
        predicted = first.argmax(dim=-1, keepdim=True)  # (B, 1)
        orders = {name: found.flatten(1).argsort(dim=1, descending=True, stable=True) for name, found in maps.items()}
        curves: dict[str, list[Tensor]] = {name: [first.gather(1, predicted)[:, 0]] for name in maps}
        for erased in counts[1:]:  # one batch per map and step: no more memory than one forward pass of B
            for name, order in orders.items():
                masks = patch_masks(order, erased, tuple(grid), images.shape[-2:])
                curves[name].append(probabilities(torch.where(masks, backgrounds, images)).gather(1, predicted)[:, 0])
    return counts, {name: torch.stack(rows, dim=1) for name, rows in curves.items()}


def curve_area(counts: list[int], curves: Tensor) -> Tensor:
    """The area under each curve (B, S + 1) over the fraction erased, k / N from 0 to 1 (trapezoids): (B,)."""
    fractions = torch.tensor(counts, dtype=curves.dtype, device=curves.device) / counts[-1]
    return torch.trapezoid(curves, fractions, dim=1)


class DeletionScores(NamedTuple):
    """``canvas_deletion``'s measures: images, accuracy, erased counts, and per map its mean area and mean curve."""

    images: int
    accuracy: float
    counts: list[int]
    area: dict[str, float]
    curves: dict[str, list[float]]


def canvas_deletion(classifier: Classifier, images: Tensor, labels: Tensor, *, canvas_size: int, steps: int = 16,
                    seed: int = 0, head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                    background_noise: int = 0, background: Background | None = None, batch_size: int = 64,
                    on_batch: Callable[[int, int], None] | None = None) -> DeletionScores:
    """Deletion curves of Fashion-MNIST items (N, 28, 28) on the canvases of ``canvas_batches``, erased patches
    filled with what lay under the item; ``on_batch`` sees each batch's image count and the total."""
    shuffle = torch.Generator().manual_seed(seed + 2)
    resize, device = eval_transform(classifier.image_size), classifier.device
    def probabilities(inputs: Tensor) -> Tensor:
        return classifier.model(inputs).float().softmax(dim=-1)
    correct, areas, means, counts = 0, {name: [] for name in DELETION_MAPS}, {}, []
    for start, _, canvases, drawn in canvas_batches(classifier, images, canvas_size=canvas_size, seed=seed,
                                                    background_noise=background_noise, background=background,
                                                    batch_size=batch_size):
        inputs = normalize(resize(canvases), classifier.mean, classifier.std).to(device)
        backgrounds = normalize(resize(drawn), classifier.mean, classifier.std).to(device)
        found = explain(classifier.model, inputs, head_fusion=head_fusion, discard_ratio=discard_ratio,
                        gradient_class="predicted")
        correct += int((found.logits.argmax(-1).cpu() == labels[start : start + len(canvases)]).sum())
        maps = {**named_maps(found), "random": torch.rand(found.rollout.shape, generator=shuffle).to(device)}
        counts, curves = deletion_curves(probabilities, inputs, backgrounds, maps, steps=steps)
        for name, curve in curves.items():
            areas[name].append(curve_area(counts, curve).cpu())
            means[name] = means.get(name, 0) + curve.sum(dim=0).cpu()
        if on_batch is not None:
            on_batch(len(canvases), len(images))
    return DeletionScores(len(images), correct / len(images), counts,
                          {name: float(torch.cat(found).mean()) for name, found in areas.items()},
                          {name: (total / len(images)).tolist() for name, total in means.items()})


def fashion_mnist_deletion(checkpoint: str | os.PathLike, *, root: str | os.PathLike = "data/fashion_mnist",
                           count: int = 1000, canvas_size: int = 56, steps: int = 16, seed: int = 0,
                           head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, background_noise: int = 0,
                           background: Background | None = None, batch_size: int = 64, device: str = "cpu",
                           on_batch: Callable[[int, int], None] | None = None) -> DeletionScores:
    """``canvas_deletion`` of a checkpoint on the first ``count`` Fashion-MNIST test items."""
    if canvas_size < 28:
        raise ValueError(f"the canvas size must be at least 28 (the item's size), got {canvas_size}")
    TestCanvasFill.check(background_noise, background)
    classifier = Classifier.from_checkpoint(checkpoint, device=device)
    images, labels = load_fashion_mnist(find_fashion_mnist(root), "test")
    if not 1 <= count <= len(images):
        raise ValueError(f"count must be from 1 to the {len(images)} Fashion-MNIST test items, got {count}")
    return canvas_deletion(classifier, images[:count], labels[:count], canvas_size=canvas_size, steps=steps,
                           seed=seed, head_fusion=head_fusion, discard_ratio=discard_ratio,
                           background_noise=background_noise, background=background, batch_size=batch_size,
                           on_batch=on_batch)
