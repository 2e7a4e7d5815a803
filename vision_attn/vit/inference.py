"""Classifying image files with a trained ViT checkpoint."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from vision_attn.checkpoint import load_module
from vision_attn.data.images import eval_transform, normalize, open_image, to_tensor
from vision_attn.vit.module import ViTClassifier


def load_classifier(path: str | os.PathLike, *, device: str = "cpu") -> ViTClassifier:
    """A ViTClassifier from a checkpoint, in eval mode on ``device``."""
    module = load_module(ViTClassifier, path, kind="vit")
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
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        batch = torch.stack([preprocess(module, path) for path in chunk]).to(device)
        probabilities = module(batch).softmax(dim=-1)
        values, indices = probabilities.topk(top_k, dim=-1)
        for path, row_values, row_indices in zip(chunk, values.tolist(), indices.tolist(), strict=True):
            yield str(path), [(names[i], p) for p, i in zip(row_values, row_indices, strict=True)]
