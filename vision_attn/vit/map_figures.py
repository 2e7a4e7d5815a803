"""The ViT's attention maps drawn over its images: per image file, and the figures a ViT task logs."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from PIL import Image
from torch import Tensor

from vision_attn.data.images import BadImageCounter, OnBadImage, denormalize, open_image, readable_batches, to_pil
from vision_attn.overlay import fit_within, vit_figure
from vision_attn.vit.classifier import Classifier, Opener, centre_square
from vision_attn.vit.rollout import HeadFusion, explain


class Overlay(NamedTuple):
    """One image's figure, with the file it was drawn from and its caption or predicted class."""

    source: str
    figure: Image.Image
    text: str


def vit_overlays(classifier: Classifier, paths: Sequence[str | os.PathLike], *, head_fusion: HeadFusion = "mean",
                 discard_ratio: float = 0.0, gradient_class: int | None = None, panel_size: int = 224, columns: int = 5,
                 batch_size: int = 32, on_bad_image: OnBadImage = "error", bad_images: BadImageCounter | None = None,
                 opener: Opener = open_image, **style: Any) -> Iterator[Overlay]:
    """An overlay per image (``opener`` reads it), titled "class probability"; the maps lie on the centre square
    the ViT saw, the rest dimmed."""
    for chunk, batch in readable_batches(paths, lambda item: classifier.preprocess(item, opener),
                                         batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        maps = explain(classifier.model, batch.to(classifier.device), head_fusion=head_fusion,
                       discard_ratio=discard_ratio, gradient_class=gradient_class)
        for index, path in enumerate(chunk):
            shown = fit_within(opener(path, mode="RGB", max_side=2 * panel_size), panel_size)
            label = classifier.title(maps.logits[index])
            figure = vit_figure(shown, maps, index, classifier.class_names, box=centre_square(shown.size), title=label,
                                head_fusion=head_fusion, discard_ratio=discard_ratio, gradient_class=gradient_class,
                                columns=columns, **style)
            yield Overlay(str(path), figure, label)


def validation_figures(classifier: Classifier, images: Tensor, labels: Tensor) -> list[tuple[str, Image.Image]]:
    """(tag, figure) of the rollout and last-layer heads of normalised images, titled with prediction and truth."""
    pixels = denormalize(images, classifier.mean, classifier.std)
    was_training = classifier.model.training
    classifier.model.eval()
    maps = explain(classifier.model, images)
    classifier.model.train(was_training)
    figures = []
    for index, (image, label) in enumerate(zip(pixels, labels.tolist(), strict=True)):
        title = f"{classifier.title(maps.logits[index], digits=0)} (true: {classifier.class_names[label]})"
        shown = fit_within(to_pil(image), 112)
        figures.append((f"val_overlay/{index}", vit_figure(shown, maps, index, classifier.class_names, title=title)))
    return figures
