"""Whether a trained ViT looks at the garment: how much of each map lies on Fashion-MNIST items pasted on a larger
canvas, and the pointing game (``vision-attn rollout-mass``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
    """``rollout_on_canvas``'s measures: images, accuracy, each map's scores, and the item's mean area share."""

    images: int
    accuracy: float
    maps: dict[str, MapScores]
    mask_area_share: float


MAP_NAMES = ("rollout", "gradient rollout", "last layer")  # the last: its heads' mean, from the pooled token(s)
CANVAS_PIXELS_PER_BATCH = 256 * 128 * 128  # canvases drawn at once: 256 up to 128 pixels a side, fewer when larger


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


def rollout_on_canvas(classifier: Classifier, images: Tensor, labels: Tensor, *, canvas_size: int, seed: int = 0,
                      head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, background_noise: int = 0,
                      background: Background | None = None, batch_size: int = 256) -> CanvasScores:
    """Items (N, 28, 28) on canvases (``canvas_batches``), resized as the ViT reads files: accuracy, each map's
    mass on the item (pixels > 0) and pointing game, and the item's area share (what a blind map scores)."""
    resize = eval_transform(classifier.image_size)  # as `classify` sees a file
    correct, areas = 0, []
    scores: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in MAP_NAMES}
    for start, canvases, filled, _ in canvas_batches(classifier, images, canvas_size=canvas_size, seed=seed,
                                                     background_noise=background_noise, background=background,
                                                     batch_size=batch_size):
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


def fashion_mnist_rollout_mass(checkpoint: str | os.PathLike, *, root: str | os.PathLike = "data/fashion_mnist",
                               count: int = 1000, canvas_size: int = 56, seed: int = 0,
                               head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                               background_noise: int = 0, background: Background | None = None,
                               device: str = "cpu") -> CanvasScores:
    """``rollout_on_canvas`` of a checkpoint on the first ``count`` Fashion-MNIST test items."""
    if canvas_size < 28:
        raise ValueError(f"the canvas size must be at least 28 (the item's size), got {canvas_size}")
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    TestCanvasFill.check(background_noise, background)
    images, labels = load_fashion_mnist(find_fashion_mnist(root), "test")
    if count > len(images):
        raise ValueError(f"count {count} is more than the {len(images)} Fashion-MNIST test items")
    classifier = Classifier.from_checkpoint(checkpoint, device=device)
    return rollout_on_canvas(classifier, images[:count], labels[:count], canvas_size=canvas_size, seed=seed,
                             head_fusion=head_fusion, discard_ratio=discard_ratio, background_noise=background_noise,
                             background=background)
