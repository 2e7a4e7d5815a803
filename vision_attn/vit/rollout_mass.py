"""Whether a trained ViT looks at the garment, on Fashion-MNIST items pasted on a larger canvas: how much of each map
lies on the item, the pointing game (``vision-attn rollout-mass``), and deletion curves (``docs/formats/metrics.md``,
``vision-attn deletion``): the probability of the predicted class as a map's top k patches are erased, k = 0 .. N;
a map pointing at the evidence has a lower area under it than a random order."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from vision_attn.data.backgrounds import Background, TestCanvasFill
from vision_attn.data.classification_datasets import eval_transform
from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist, place_on_canvas, random_places
from vision_attn.data.images import normalize
from vision_attn.metrics import mask_mass, pointing_game
from vision_attn.vit.classifier import Classifier
from vision_attn.vit.rollout import AttentionMaps, HeadFusion, explain


class MapScores(NamedTuple):
    """How one kind of map finds the item: its mean mass on it (docs/formats/metrics.md), its pointing-game hit rate."""

    mass_in_mask: float
    pointing: float


class CanvasScores(NamedTuple):
    """``fashion_mnist_rollout_mass``'s measures: images, accuracy, each map's scores, the item's mean area share."""

    images: int
    accuracy: float
    maps: dict[str, MapScores]
    mask_area_share: float


MAP_NAMES = ("rollout", "gradient rollout", "last layer")  # the last: its heads' mean, from the pooled token(s)
CANVAS_PIXELS_PER_BATCH = 256 * 128 * 128  # canvases drawn at once: 256 up to 128 pixels a side, fewer when larger
DELETION_MAPS = ("rollout", "gradient rollout", "last layer", "random")
# images (B, C, H, W) as the model takes them -> class probabilities (B, classes)
Probabilities = Callable[[Tensor], Tensor]


def named_maps(maps: AttentionMaps) -> dict[str, Tensor]:
    """The maps (B, Gh, Gw) of ``MAP_NAMES`` that ``maps`` holds (gradient rollout only when it was asked for)."""
    found = {"rollout": maps.rollout, "gradient rollout": maps.gradient_rollout, "last layer": maps.heads.mean(dim=1)}
    return {name: found[name] for name in MAP_NAMES if found[name] is not None}


def map_scores(maps: AttentionMaps, masks: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Per map of ``named_maps``: each image's mass on ``masks`` (B, H, W) and pointing-game hit."""
    masks = masks.to(maps.rollout.device)
    return {name: (mask_mass(found, masks), pointing_game(found, masks)) for name, found in named_maps(maps).items()}


def canvas_batches(classifier: Classifier, images: Tensor, *, canvas_size: int, seed: int, background_noise: int,
                   background: Background | None, batch_size: int) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
    """Per batch of items (N, 28, 28) at random places: its first index, and uint8 (B, 1, S, S) the black canvases,
    those filled by ``TestCanvasFill`` and what lies under the items."""
    if classifier.in_chans != 1:
        raise ValueError("the canvas check needs a 1-channel (Fashion-MNIST) ViT checkpoint")
    places = random_places(len(images), canvas_size, generator=torch.Generator().manual_seed(seed))
    under = TestCanvasFill(seed, noise=background_noise, background=background)
    batch_size = max(1, min(batch_size, CANVAS_PIXELS_PER_BATCH // canvas_size**2))
    for start in range(0, len(images), batch_size):
        items = images[start : start + batch_size, None]
        canvases = place_on_canvas(items, places[start : start + batch_size], canvas_size)
        yield start, canvases, *under.fill(canvases, items)  # every pixel filled but the item's (its mask)


def fashion_mnist_canvas_inputs(checkpoint: str | os.PathLike, root: str | os.PathLike, count: int, canvas_size: int,
                                background_noise: int, background: Background | None,
                                device: str) -> tuple[Classifier, Tensor, Tensor]:
    """The classifier of a checkpoint, the first ``count`` Fashion-MNIST test items (N, 28, 28) and their labels,
    each argument checked first."""
    if canvas_size < 28:
        raise ValueError(f"the canvas size must be at least 28 (the item's size), got {canvas_size}")
    TestCanvasFill.check(background_noise, background)
    classifier = Classifier.from_checkpoint(checkpoint, device=device)
    images, labels = load_fashion_mnist(find_fashion_mnist(root), "test")
    if not 1 <= count <= len(images):
        raise ValueError(f"count must be from 1 to the {len(images)} Fashion-MNIST test items, got {count}")
    return classifier, images[:count], labels[:count]


def fashion_mnist_rollout_mass(checkpoint: str | os.PathLike, *, root: str | os.PathLike = "data/fashion_mnist",
                               count: int = 1000, canvas_size: int = 56, seed: int = 0,
                               head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                               background_noise: int = 0, background: Background | None = None,
                               device: str = "cpu") -> CanvasScores:
    """A checkpoint on the first ``count`` Fashion-MNIST test items on canvases (``canvas_batches``), resized as the
    ViT reads files: accuracy, each map's mass on the item (pixels > 0) and pointing game, and the item's area
    share (what a blind map scores)."""
    classifier, images, labels = fashion_mnist_canvas_inputs(checkpoint, root, count, canvas_size, background_noise,
                                                             background, device)
    resize = eval_transform(classifier.image_size)  # as `classify` sees a file
    correct, areas = 0, []
    scores: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in MAP_NAMES}
    for start, canvases, filled, _ in canvas_batches(classifier, images, canvas_size=canvas_size, seed=seed,
                                                     background_noise=background_noise, background=background,
                                                     batch_size=256):
        pixels = resize(canvases)  # (B, 1, S, S) uint8
        masks = pixels[:, 0] > 0  # the item's pixels in the input
        inputs = normalize(pixels if filled is canvases else resize(filled), classifier.mean,
                           classifier.std).to(classifier.device)
        maps = explain(classifier.model, inputs, head_fusion=head_fusion, discard_ratio=discard_ratio,
                       gradient_class="predicted")
        correct += int((maps.logits.argmax(-1).cpu() == labels[start : start + len(canvases)]).sum())
        for name, pair in map_scores(maps, masks).items():
            scores[name].append(pair)
        areas.append(masks.float().mean(dim=(-2, -1)))
    maps = {name: MapScores(float(torch.cat([mass for mass, _ in pairs]).mean()),
                            float(torch.cat([hit for _, hit in pairs]).float().mean()))
            for name, pairs in scores.items()}
    return CanvasScores(len(images), correct / len(images), maps, float(torch.cat(areas).mean()))


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
    """``fashion_mnist_deletion``'s measures: images, accuracy, erased counts, per map its mean area and mean curve."""

    images: int
    accuracy: float
    counts: list[int]
    area: dict[str, float]
    curves: dict[str, list[float]]


def fashion_mnist_deletion(checkpoint: str | os.PathLike, *, root: str | os.PathLike = "data/fashion_mnist",
                           count: int = 1000, canvas_size: int = 56, steps: int = 16, seed: int = 0,
                           head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, background_noise: int = 0,
                           background: Background | None = None, batch_size: int = 64, device: str = "cpu",
                           on_batch: Callable[[int, int], None] | None = None) -> DeletionScores:
    """Deletion curves of a checkpoint on the first ``count`` Fashion-MNIST test items on the canvases of
    ``canvas_batches``, erased patches filled with what lay under the item; ``on_batch`` sees each batch's image
    count and the total."""
    classifier, images, labels = fashion_mnist_canvas_inputs(checkpoint, root, count, canvas_size, background_noise,
                                                             background, device)
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
