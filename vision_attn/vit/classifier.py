"""A ViT classifier without Lightning: the network of a ViT task's groups, and a trained one classifying images."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
from PIL import Image
from torch import Tensor

from vision_attn.checkpoint import VIT, load_weights, read_model_checkpoint
from vision_attn.data.classification_datasets import eval_transform
from vision_attn.data.images import BadImageCounter, OnBadImage, normalize, open_image, readable_batches, to_tensor
from vision_attn.errors import CheckpointError
from vision_attn.option_groups import ImageFormat
from vision_attn.vit.classifier_options import ViTArchitecture, ViTTraining
from vision_attn.vit.vision_transformer import VisionTransformer

Item = TypeVar("Item")
# An image input (by default a file, read by ``open_image``; ``vision_attn.api`` passes one that also reads PIL
# images), ``mode=`` ("RGB" or "L") and ``max_side=``, the longest side the caller needs -> the image decoded upright
# in that mode
Opener = Callable[..., Image.Image]


def build_vit(image: ImageFormat, num_classes: int, architecture: ViTArchitecture,
              training: ViTTraining | None = None) -> VisionTransformer:
    """The ``VisionTransformer`` of a ViT task's groups, for ``image``'s size and channels."""
    training = training or ViTTraining()
    return VisionTransformer(img_size=image.size, in_chans=image.channels, num_classes=num_classes,
                             **asdict(architecture), drop_rate=training.drop_rate,
                             attn_drop_rate=training.attn_drop_rate, drop_path_rate=training.drop_path_rate,
                             patch_drop_rate=training.patch_drop_rate)


def vit_from_hparams(hparams: Mapping[str, Any]) -> VisionTransformer:
    """The ``VisionTransformer`` of a ViT checkpoint's hyper-parameters (``checkpoint.read_model_checkpoint``)."""
    return build_vit(ImageFormat.coerce(hparams.get("image")), hparams["num_classes"],
                     ViTArchitecture.coerce(hparams.get("architecture")), ViTTraining.coerce(hparams.get("training")))


@dataclass
class Classifier:
    """A trained ViT with what it needs to read images: class names, input size, channels and normalisation."""

    model: VisionTransformer
    class_names: list[str]
    image_size: int
    in_chans: int
    mean: list[float]
    std: list[float]

    @classmethod
    def from_hparams(cls, model: VisionTransformer, hparams: Mapping[str, Any]) -> Classifier:
        """``model`` with a ViT task's hyper-parameters (classes named by index, mean = std = 0.5 by default)."""
        image = ImageFormat.coerce(hparams.get("image"))
        mean, std = image.normalisation([0.5] * image.channels, [0.5] * image.channels)
        return cls(model, list(hparams.get("class_names") or [str(i) for i in range(hparams["num_classes"])]),
                   image.size, image.channels, mean, std)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        loaded: Mapping[str, Any] | None = None) -> Classifier:
        """The classifier of a ``vision-attn fit`` checkpoint, in eval mode on ``device``."""
        saved = read_model_checkpoint(path, kind=VIT, loaded=loaded)
        try:
            model = vit_from_hparams(saved.hparams)
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: not the weights of a ViT ({type(error).__name__}: {error})") from None
        load_weights(model, saved.state_dict, source=path)
        return cls.from_hparams(model.to(device).eval(), saved.hparams)

    @property
    def device(self) -> torch.device:
        """The device the network is on."""
        return next(self.model.parameters()).device

    def preprocess(self, path: Any, opener: Opener = open_image) -> Tensor:
        """An image file (or what ``opener`` reads, in "L" for a 1-channel network, else "RGB") as the network's
        normalised input (C, H, W): its centre square."""
        mode = "L" if self.in_chans == 1 else "RGB"
        pixels = eval_transform(self.image_size)(to_tensor(opener(path, mode=mode, max_side=2 * self.image_size)))
        return normalize(pixels, self.mean, self.std)

    def class_index(self, name_or_index: str) -> int:
        """A class given by name or by index, checked against the checkpoint's classes."""
        if name_or_index in self.class_names:
            return self.class_names.index(name_or_index)
        if name_or_index.isdigit() and int(name_or_index) < len(self.class_names):
            return int(name_or_index)
        raise ValueError(f"unknown class {name_or_index!r}: the checkpoint's classes are {', '.join(self.class_names)}")

    def title(self, logits: Tensor, digits: int = 1) -> str:
        """"<class> <probability>" of the top class of one image's logits (C,)."""
        probability, predicted = logits.softmax(dim=-1).max(dim=0)
        return f"{self.class_names[predicted]} {probability.item():.{digits}%}"


@torch.inference_mode()
def classify_batches(classifier: Classifier, items: Sequence[Item], *, opener: Opener = open_image,
                     batch_size: int = 64, on_bad_image: OnBadImage = "error",
                     bad_images: BadImageCounter | None = None) -> Iterator[tuple[Item, Tensor]]:
    """(item, its float32 CPU logits (C,)) for each readable image, in order; an unreadable one raises BadImageError,
    or with ``on_bad_image="skip"`` is left out with a warning (and counted in ``bad_images``)."""
    for chunk, batch in readable_batches(items, lambda item: classifier.preprocess(item, opener),
                                         batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        logits = classifier.model(batch.to(classifier.device)).float().cpu()
        yield from zip(chunk, logits, strict=True)


def ranked(classifier: Classifier, logits: Tensor, top_k: int = 5) -> list[tuple[str, float]]:
    """[(class name, probability)] of one image's logits (C,), the ``top_k`` best first (all when fewer)."""
    top_k = max(1, min(top_k, len(classifier.class_names)))
    values, indices = logits.softmax(dim=-1).topk(top_k)
    return [(classifier.class_names[i], p) for p, i in zip(values.tolist(), indices.tolist(), strict=True)]


def centre_square(size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box (left, top, right, bottom) of an image of ``size`` (W, H) that ``eval_transform`` keeps."""
    (width, height), side = size, min(size)
    left, top = round((width - side) / 2), round((height - side) / 2)
    return left, top, left + side, top + side
