"""Classifying image files with a trained ViT checkpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from vision_attn.checkpoint import load_module
from vision_attn.data.images import (
    BadImageCounter,
    OnBadImage,
    eval_transform,
    normalize,
    open_image,
    readable_batches,
    to_tensor,
)
from vision_attn.overlay import fit_within, vit_figure
from vision_attn.vit.module import ViTClassifier
from vision_attn.vit.rollout import HeadFusion, explain


def load_classifier(path: str | os.PathLike, *, device: str = "cpu", loaded: dict | None = None) -> ViTClassifier:
    """A ViTClassifier from a checkpoint, in eval mode on ``device``."""
    module = load_module(ViTClassifier, path, kind="vit", loaded=loaded)
    return module.to(device).eval()


def preprocess(module: ViTClassifier, path: str | os.PathLike) -> Tensor:
    """An image file as the network input the checkpoint was trained on: (C, H, W), normalised."""
    hparams = module.hparams
    image = open_image(path, mode="L" if hparams.in_chans == 1 else "RGB", max_side=2 * hparams.image_size)
    pixels = eval_transform(hparams.image_size)(to_tensor(image))  # uint8 (C, H, W)
    return normalize(pixels, hparams.mean or [0.5] * hparams.in_chans, hparams.std or [0.5] * hparams.in_chans)


@torch.inference_mode()
def classify_files(
    module: ViTClassifier, paths: Sequence[str | os.PathLike], *, top_k: int = 5, batch_size: int = 64
) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """(path, [(class name, probability)] best first) for each image."""
    names = module.hparams.class_names or [str(i) for i in range(module.hparams.num_classes)]
    top_k = max(1, min(top_k, len(names)))
    device = next(module.parameters()).device
    for chunk, batch in readable_batches(paths, lambda path: preprocess(module, path), batch_size=batch_size):
        probabilities = module(batch.to(device)).softmax(dim=-1)
        values, indices = probabilities.topk(top_k, dim=-1)
        for path, row_values, row_indices in zip(chunk, values.tolist(), indices.tolist(), strict=True):
            yield str(path), [(names[i], p) for p, i in zip(row_values, row_indices, strict=True)]


def class_index(module: ViTClassifier, name_or_index: str) -> int:
    """A class given by name or by index, checked against the checkpoint's classes."""
    names = module.hparams.class_names or [str(i) for i in range(module.hparams.num_classes)]
    if name_or_index in names:
        return names.index(name_or_index)
    if name_or_index.isdigit() and int(name_or_index) < len(names):
        return int(name_or_index)
    raise ValueError(f"unknown class {name_or_index!r}: the checkpoint's classes are {', '.join(names)}")


def centre_square(size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box (left, top, right, bottom) of an image of ``size`` (W, H) that ``eval_transform`` keeps."""
    width, height = size
    side = min(width, height)
    left, top = round((width - side) / 2), round((height - side) / 2)
    return left, top, left + side, top + side


def vit_overlays(
    module: ViTClassifier,
    paths: Sequence[str | os.PathLike],
    *,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
    gradient_class: int | None = None,
    panel_size: int = 224,
    columns: int = 5,
    batch_size: int = 32,
    on_bad_image: OnBadImage = "error",
    bad_images: BadImageCounter | None = None,
    **style: Any,
) -> Iterator[tuple[str, Image.Image, str]]:
    """(path, figure, "class probability") per image, figures as ``vit_figure`` draws them.

    The ViT saw the centre square of each image, so the maps are drawn there; the rest is dimmed.
    """
    names = module.hparams.class_names or [str(i) for i in range(module.hparams.num_classes)]
    for chunk, batch in readable_batches(paths, lambda path: preprocess(module, path), batch_size=batch_size,
                                         on_bad_image=on_bad_image, bad_images=bad_images):
        maps = explain(module.model, batch.to(module.device), head_fusion=head_fusion, discard_ratio=discard_ratio,
                       gradient_class=gradient_class)
        probabilities = maps["logits"].softmax(dim=-1)
        for index, path in enumerate(chunk):
            shown = fit_within(open_image(path, mode="RGB", max_side=2 * panel_size), panel_size)
            probability, predicted = probabilities[index].max(dim=0)
            label = f"{names[predicted]} {probability.item():.1%}"
            figure = vit_figure(shown, maps, index, names, box=centre_square(shown.size), title=label,
                                head_fusion=head_fusion, discard_ratio=discard_ratio, gradient_class=gradient_class,
                                columns=columns, **style)
            yield str(path), figure, label


@torch.no_grad()
def rollout_on_canvas(module: ViTClassifier, images: Tensor, labels: Tensor, *, canvas_size: int, seed: int = 0,
                      head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0,
                      batch_size: int = 256) -> dict[str, float]:
    """Fashion-MNIST items (N, 28, 28) pasted at random on black canvases of ``canvas_size``, seen by the ViT
    as its input pipeline would (resized to its image size): accuracy, rollout mass on the item (SPEC §5,
    the mask is the item's pixels > 0), and the item's area share (the mass of a map blind to the item)."""
    from vision_attn.metrics import mask_mass

    hparams = module.hparams
    if hparams.in_chans != 1:
        raise ValueError("the canvas check needs a 1-channel (Fashion-MNIST) ViT checkpoint")
    size = hparams.image_size
    generator = torch.Generator().manual_seed(seed)
    places = torch.randint(0, canvas_size - 27, (len(images), 2), generator=generator)
    correct, masses, areas = 0, [], []
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        canvases = torch.zeros(len(chunk), 1, canvas_size, canvas_size, dtype=torch.uint8)
        for index, (left, top) in enumerate(places[start : start + batch_size].tolist()):
            canvases[index, 0, top : top + 28, left : left + 28] = chunk[index]
        pixels = eval_transform(size)(canvases)  # (B, 1, S, S) uint8, as `classify` and `overlay` see a file
        masks = pixels[:, 0] > 0
        inputs = normalize(pixels, hparams.mean or [0.5], hparams.std or [0.5]).to(module.device)
        maps = explain(module.model, inputs, head_fusion=head_fusion, discard_ratio=discard_ratio)
        correct += int((maps["logits"].argmax(-1).cpu() == labels[start : start + batch_size]).sum())
        masses.append(mask_mass(maps["rollout"].cpu(), masks))
        areas.append(masks.float().mean(dim=(-2, -1)))
    return {"images": float(len(images)), "accuracy": correct / len(images),
            "rollout_mass_in_mask": float(torch.cat(masses).mean()), "mask_area_share": float(torch.cat(areas).mean())}
