"""A trained ViT at work, without Lightning: classifying image files, drawing where it looked, and measuring
whether it looks at the garment (items pasted on a larger canvas)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, TypeVar

import torch
from PIL import Image
from torch import Tensor

from vision_attn.checkpoint import VIT, load_weights, read_model_checkpoint
from vision_attn.data.backgrounds import Background, TestCanvasFill
from vision_attn.data.classification import eval_transform
from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist, place_on_canvas, random_places
from vision_attn.data.images import (
    BadImageCounter,
    OnBadImage,
    denormalize,
    normalize,
    open_image,
    readable_batches,
    to_pil,
    to_tensor,
)
from vision_attn.errors import CheckpointError
from vision_attn.metrics import mask_mass, pointing_game
from vision_attn.option_groups import ImageFormat
from vision_attn.overlay import fit_within, vit_figure
from vision_attn.vit.options import ViTArchitecture, ViTTraining
from vision_attn.vit.rollout import AttentionMaps, HeadFusion, explain
from vision_attn.vit.vision_transformer import VisionTransformer

Item = TypeVar("Item")
# An image input (by default a file; ``vision_attn.api`` passes one that also reads PIL images), a mode ("RGB" or
# "L") and the longest side the caller needs -> the image decoded upright in that mode
Opener = Callable[[Any, str, int], Image.Image]


def open_file(path: str | os.PathLike, mode: str, max_side: int) -> Image.Image:
    """The default ``Opener``: an image file decoded upright in ``mode`` (``open_image``)."""
    return open_image(path, mode=mode, max_side=max_side)


def build_vit(image: ImageFormat, num_classes: int, architecture: ViTArchitecture,
              training: ViTTraining | None = None) -> VisionTransformer:
    """The ``VisionTransformer`` of a ViT task's groups: ``architecture`` as it is, for ``image``'s size and channels,
    with ``training``'s dropout rates."""
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
        """The metadata of a ViT task's hyper-parameters around ``model``, with the defaults filled in: classes
        named by their index, and mean = std = 0.5 per channel."""
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

    @property
    def mode(self) -> str:
        """The PIL mode images are read in: "L" for a 1-channel network, else "RGB"."""
        return "L" if self.in_chans == 1 else "RGB"

    def prepare(self, image: Image.Image) -> Tensor:
        """A decoded image in ``mode`` as the network input the checkpoint was trained on: (C, H, W), normalised
        (the shorter side resized to the input size, then the centre square)."""
        pixels = eval_transform(self.image_size)(to_tensor(image))  # uint8 (C, H, W)
        return normalize(pixels, self.mean, self.std)

    def preprocess(self, path: Any, opener: Opener = open_file) -> Tensor:
        """An image file (or what ``opener`` reads) as the network input: (C, H, W), normalised."""
        return self.prepare(opener(path, self.mode, 2 * self.image_size))

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
def classify_batches(classifier: Classifier, items: Sequence[Item], *, opener: Opener = open_file,
                     batch_size: int = 64, on_bad_image: OnBadImage = "error",
                     bad_images: BadImageCounter | None = None) -> Iterator[tuple[Item, Tensor]]:
    """(item, its logits (C,) as float32 on the CPU) for each readable image, in order, ``batch_size`` at a time.
    ``opener`` reads an item (default: an image file). An unreadable image raises BadImageError naming it, or
    with ``on_bad_image="skip"`` is left out with a logged warning (and counted in ``bad_images``)."""
    for chunk, batch in readable_batches(items, lambda item: classifier.preprocess(item, opener),
                                         batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        logits = classifier.model(batch.to(classifier.device)).float().cpu()
        yield from zip(chunk, logits, strict=True)


def ranked(classifier: Classifier, logits: Tensor, top_k: int = 5) -> list[tuple[str, float]]:
    """[(class name, probability)] of one image's logits (C,), the ``top_k`` best first (all when fewer)."""
    top_k = max(1, min(top_k, len(classifier.class_names)))
    values, indices = logits.softmax(dim=-1).topk(top_k)
    return [(classifier.class_names[i], p) for p, i in zip(values.tolist(), indices.tolist(), strict=True)]


def classify_files(classifier: Classifier, paths: Sequence[str | os.PathLike], *, top_k: int = 5,
                   batch_size: int = 64, on_bad_image: OnBadImage = "error",
                   bad_images: BadImageCounter | None = None) -> Iterator[tuple[str, list[tuple[str, float]]]]:
    """(path, [(class name, probability)] best first) for each readable image (``classify_batches``)."""
    for path, logits in classify_batches(classifier, paths, batch_size=batch_size, on_bad_image=on_bad_image,
                                         bad_images=bad_images):
        yield str(path), ranked(classifier, logits, top_k)


def centre_square(size: tuple[int, int]) -> tuple[int, int, int, int]:
    """The box (left, top, right, bottom) of an image of ``size`` (W, H) that ``eval_transform`` keeps."""
    width, height = size
    side = min(width, height)
    left, top = round((width - side) / 2), round((height - side) / 2)
    return left, top, left + side, top + side


class Overlay(NamedTuple):
    """One image's figure, with the file it was drawn from and its caption or predicted class."""

    source: str
    figure: Image.Image
    text: str


def vit_overlays(
    classifier: Classifier,
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
    opener: Opener = open_file,
    **style: Any,
) -> Iterator[Overlay]:
    """An overlay per image, titled "class probability", as ``vit_figure`` draws it. ``opener`` reads an item of
    ``paths`` (default: an image file).

    The ViT saw the centre square of each image, so the maps are drawn there; the rest is dimmed.
    """
    for chunk, batch in readable_batches(paths, lambda item: classifier.preprocess(item, opener),
                                         batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        maps = explain(classifier.model, batch.to(classifier.device), head_fusion=head_fusion,
                       discard_ratio=discard_ratio, gradient_class=gradient_class)
        for index, path in enumerate(chunk):
            shown = fit_within(opener(path, "RGB", 2 * panel_size), panel_size)
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


class MapScores(NamedTuple):
    """How one kind of map finds the item: its mean mass on the item (docs/formats/metrics.md) and its pointing-game
    hit rate."""

    mass_in_mask: float
    pointing: float


class CanvasScores(NamedTuple):
    """``rollout_on_canvas``'s measures: images used, accuracy, each map's scores (``MAP_NAMES``), and the mean
    area share of the item (what a map blind to it would score, in mass and about in pointing)."""

    images: int
    accuracy: float
    maps: dict[str, MapScores]
    mask_area_share: float


MAP_NAMES = ("rollout", "gradient rollout", "last layer")  # the last: its heads' mean, from the pooled token(s)
CANVAS_PIXELS_PER_BATCH = 256 * 128 * 128  # canvases drawn at once: 256 up to 128 pixels a side, fewer when larger


def map_scores(maps: AttentionMaps, masks: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """Per map of ``MAP_NAMES`` that ``maps`` holds (gradient rollout only when it was asked for): its mass on
    the mask (docs/formats/metrics.md) and its pointing-game hit, per image. ``masks`` (B, H, W) are at the input's
    size."""
    masks = masks.to(maps.rollout.device)
    found = {"rollout": maps.rollout, "gradient rollout": maps.gradient_rollout, "last layer": maps.heads.mean(dim=1)}
    return {name: (mask_mass(found[name], masks), pointing_game(found[name], masks))
            for name in MAP_NAMES if found[name] is not None}


def rollout_on_canvas(classifier: Classifier, images: Tensor, labels: Tensor, *, canvas_size: int, seed: int = 0,
                      head_fusion: HeadFusion = "mean", discard_ratio: float = 0.0, background_noise: int = 0,
                      background: Background | None = None, batch_size: int = 256) -> CanvasScores:
    """Fashion-MNIST items (N, 28, 28) pasted at random on black canvases of ``canvas_size``, seen by the ViT
    as its input pipeline would (resized to its image size): accuracy, and for rollout, gradient rollout and
    the last layer's attention the mass on the item (docs/formats/metrics.md, the mask is the item's pixels > 0) and the
    pointing game; and the item's area share (the mass of a map blind to the item).

    ``background_noise`` (0..255) fills every pixel but the item's with uniform grey noise up to that level
    (the mask stays the item's own pixels), where a map that finds "whatever is not black" no longer finds the
    item; ``background`` draws one of the scenes' backgrounds under each item instead (``data.backgrounds``)."""
    if classifier.in_chans != 1:
        raise ValueError("the canvas check needs a 1-channel (Fashion-MNIST) ViT checkpoint")
    places = random_places(len(images), canvas_size, generator=torch.Generator().manual_seed(seed))
    under = TestCanvasFill(seed, noise=background_noise, background=background)
    batch_size = max(1, min(batch_size, CANVAS_PIXELS_PER_BATCH // canvas_size**2))  # large canvases: fewer at once
    correct, areas = 0, []
    scores: dict[str, list[tuple[Tensor, Tensor]]] = {name: [] for name in MAP_NAMES}
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size, None]
        canvases = place_on_canvas(chunk, places[start : start + batch_size], canvas_size)
        pixels = eval_transform(classifier.image_size)(canvases)  # (B, 1, S, S) uint8, as `classify` sees a file
        masks = pixels[:, 0] > 0  # the item's pixels in the input
        filled, _ = under.fill(canvases, chunk)  # every pixel but the item's (its mask)
        if filled is not canvases:
            pixels = eval_transform(classifier.image_size)(filled)
        inputs = normalize(pixels, classifier.mean, classifier.std).to(classifier.device)
        maps = explain(classifier.model, inputs, head_fusion=head_fusion, discard_ratio=discard_ratio,
                       gradient_class="predicted")
        correct += int((maps.logits.argmax(-1).cpu() == labels[start : start + batch_size]).sum())
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
