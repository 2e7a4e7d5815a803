"""The Python API: captions with their attention, classes and attention figures as typed results, through the code
of ``vision-attn caption``, ``classify`` and ``overlay`` (the same records and PNGs). Images are files, folders of
images (sorted by name) or PIL images, mixed freely. No Lightning; docs/api/index.md shows it in use::

    captioner = load_captioner("runs/captioner/best.ckpt", device="cpu")
    results = caption(captioner, ["photo.jpg", Image.open("other.png")], beam_size=3)
    caption_figure(results[0]).save("words.png")  # the picture, then one α panel per word
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.evaluation import caption_files
from vision_attn.data.coco import load_caption_image
from vision_attn.data.images import OnBadImage, expand_inputs, open_image, to_tensor
from vision_attn.io import output_file, write_json_atomically
from vision_attn.overlay import caption_overlay
from vision_attn.vit.classifier import Classifier, classify_batches, ranked
from vision_attn.vit.map_figures import vit_overlays
from vision_attn.vit.rollout import HeadFusion

__all__ = ["CaptionResult", "ClassificationResult", "ImageInput", "caption", "caption_figure", "classifier_figure",
           "classify", "iter_captions", "iter_classifications", "load_captioner", "load_classifier", "open_input",
           "write_classifications"]

ImageInput = str | os.PathLike | Image.Image  # an image file, a folder of images, or a PIL image
Images = ImageInput | Iterable[ImageInput]  # one of them, or several


def _frozen(values: Any, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(shape)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class CaptionResult:
    """One image's caption with where each word looked, as ``vision-attn caption`` records it (compare results by
    ``to_record()``). Read-only float64 arrays, rounded as in the JSON: ``alphas`` (T, Gh, Gw), word t's α;
    ``betas`` (T,); ``head_alphas`` (T, K, Gh, Gw) with a multihead score. ``image_size`` (H, W) is the network
    input's; ``source`` the path as given (a PIL image: ``"<image N>"``), ``image_id`` the file name (or N)."""

    source: str
    image_id: Any
    caption: str
    tokens: tuple[str, ...]
    alphas: np.ndarray
    betas: np.ndarray
    grid: tuple[int, int]
    image_size: tuple[int, int]
    head_alphas: np.ndarray | None = None

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CaptionResult:
        """The result of a results record (docs/formats/results.md)."""
        tokens, grid = tuple(record["tokens"]), (int(record["grid"][0]), int(record["grid"][1]))
        heads = record.get("head_alphas")
        return cls(source=record["file_name"], image_id=record["image_id"], caption=record["caption"], tokens=tokens,
                   alphas=_frozen(record["alphas"], (len(tokens), *grid)),
                   betas=_frozen(record["betas"], (len(tokens),)), grid=grid,
                   image_size=(int(record["image_size"][0]), int(record["image_size"][1])),
                   head_alphas=None if heads is None else _frozen(heads, (len(tokens), len(heads[0]) if heads else 0,
                                                                         *grid)))

    def to_record(self) -> dict[str, Any]:
        """Exactly the record ``vision-attn caption`` writes for this image (docs/formats/results.md)."""
        count, cells = len(self.tokens), self.grid[0] * self.grid[1]  # explicit: a caption may have no words
        record = {"image_id": self.image_id, "file_name": self.source, "caption": self.caption,
                  "tokens": list(self.tokens), "grid": list(self.grid), "image_size": list(self.image_size),
                  "alphas": self.alphas.reshape(count, cells).tolist(), "betas": self.betas.tolist()}
        if self.head_alphas is not None:
            record["head_alphas"] = self.head_alphas.reshape(count, self.head_alphas.shape[1], cells).tolist()
        return record


@dataclass(frozen=True)
class ClassificationResult:
    """One image's classes: ``top_k`` ((name, probability), ...) best first; ``logits`` (C,) when asked for."""

    source: str
    top_k: tuple[tuple[str, float], ...]
    logits: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        """The most probable class."""
        return self.top_k[0][0]

    @property
    def probability(self) -> float:
        """The most probable class's probability."""
        return self.top_k[0][1]

    def to_record(self) -> dict[str, Any]:
        """The image's entry in ``vision-attn classify``'s JSON, probabilities to 6 decimals."""
        return {"file_name": self.source, "label": self.label, "probability": round(self.probability, 6),
                "top_k": [{"class": name, "probability": round(p, 6)} for name, p in self.top_k]}


class _Input(NamedTuple):
    image_id: Any
    source: str
    image: Path | Image.Image


def _inputs(images: Images) -> list[_Input]:
    # each image file, each folder's image files (a missing path: one line, before any work), each PIL image
    listed = [images] if isinstance(images, str | os.PathLike | Image.Image) else list(images)
    found: list[_Input] = []
    for index, image in enumerate(listed):
        if isinstance(image, Image.Image):
            found.append(_Input(index, f"<image {index}>", image))
        elif isinstance(image, str | os.PathLike):
            found += [_Input(name, str(path), path) for name, path in expand_inputs([image])]
        else:
            raise TypeError(f"image {index}: expected a file, a folder or a PIL image, got {type(image).__name__}")
    return found


def _upright(image: Image.Image, mode: str) -> Image.Image:
    # a PIL image as open_image makes a decoded file: EXIF orientation, 16/32-bit grey to 8 bits, alpha over black
    image = ImageOps.exif_transpose(image)
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda value: value / 256).convert("L")
    if image.mode in ("P", "PA", "RGBA", "LA") and mode == "RGB":
        image = Image.alpha_composite(Image.new("RGBA", image.size, (0, 0, 0, 255)), image.convert("RGBA"))
    return image.convert(mode)


def open_input(image: ImageInput, mode: str = "RGB", max_side: int | None = None) -> Image.Image:
    """An image file or a PIL image, upright in ``mode`` ("RGB" or "L"), as the models read it."""
    if isinstance(image, Image.Image):
        return _upright(image, mode)
    return open_image(image, mode=mode, max_side=max_side)


def _open_item(item: _Input, mode: str, max_side: int) -> Image.Image:
    return open_input(item.image, mode, max_side)


def _loaded(model: Any, kind: type, load: Callable[..., Any], device: str | torch.device | None) -> Any:
    # model if it is a loaded kind (on device, when one is asked), else the checkpoint it names, loaded on device
    if not isinstance(model, kind):
        return load(model, device=device or "cpu")
    if device is not None and (torch.device(device).type, torch.device(device).index or 0) != \
            (model.device.type, model.device.index or 0):
        raise ValueError(f"the model is on {model.device}, not {device}: load it there (device=...) instead")
    return model


def _positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def load_captioner(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> Captioner:
    """The captioner of a ``vision-attn fit`` checkpoint, in eval mode on ``device``: ``Captioner.from_checkpoint``."""
    return Captioner.from_checkpoint(checkpoint, device=device)


def load_classifier(checkpoint: str | os.PathLike, *, device: str | torch.device = "cpu") -> Classifier:
    """The ViT classifier of a ``fit`` checkpoint, in eval mode on ``device``: ``Classifier.from_checkpoint``."""
    return Classifier.from_checkpoint(checkpoint, device=device)


def _caption_pixels(item: _Input, size: int) -> torch.Tensor:
    # RGB uint8 (3, size, size), the whole image squashed to the square, as load_caption_image reads a file
    if not isinstance(item.image, Image.Image):
        return load_caption_image(item.image, size)
    image = _upright(item.image, "RGB")
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BICUBIC)
    return to_tensor(image)


def iter_captions(captioner: Captioner | str | os.PathLike, images: Images, *, beam_size: int | None = None,
                  batch_size: int = 32, on_bad_image: OnBadImage = "error",
                  device: str | torch.device | None = None) -> Iterator[CaptionResult]:
    """``caption``, one result at a time as each batch is decoded (the inputs are checked before it returns)."""
    _positive(beam_size=beam_size, batch_size=batch_size)
    items = _inputs(images)
    captioner = _loaded(captioner, Captioner, load_captioner, device)
    records = caption_files(captioner, items, beam_size=beam_size, batch_size=batch_size, on_bad_image=on_bad_image,
                            load=lambda item: _caption_pixels(item, captioner.image_size))
    return map(CaptionResult.from_record, records)


def caption(captioner: Captioner | str | os.PathLike, images: Images, *, beam_size: int | None = None,
            batch_size: int = 32, on_bad_image: OnBadImage = "error",
            device: str | torch.device | None = None) -> list[CaptionResult]:
    """Caption images by beam search (``beam_size``: default the checkpoint's): one result per readable image, in
    order. ``captioner`` is loaded or a checkpoint (loaded on ``device``, default cpu). An unreadable image raises
    BadImageError, or with ``on_bad_image="skip"`` is left out with a warning."""
    return list(iter_captions(captioner, images, beam_size=beam_size, batch_size=batch_size,
                              on_bad_image=on_bad_image, device=device))


def iter_classifications(classifier: Classifier | str | os.PathLike, images: Images, *, top_k: int = 5,
                         batch_size: int = 32, on_bad_image: OnBadImage = "error",
                         device: str | torch.device | None = None,
                         logits: bool = False) -> Iterator[ClassificationResult]:
    """``classify``, one result at a time as each batch is classified (the inputs are checked before it returns)."""
    _positive(top_k=top_k, batch_size=batch_size)
    items = _inputs(images)
    classifier = _loaded(classifier, Classifier, load_classifier, device)
    return (ClassificationResult(item.source, tuple(ranked(classifier, row, top_k)),
                                 row.numpy().copy() if logits else None)
            for item, row in classify_batches(classifier, items, opener=_open_item, batch_size=batch_size,
                                              on_bad_image=on_bad_image))


def classify(classifier: Classifier | str | os.PathLike, images: Images, *, top_k: int = 5, batch_size: int = 32,
             on_bad_image: OnBadImage = "error", device: str | torch.device | None = None,
             logits: bool = False) -> list[ClassificationResult]:
    """The ``top_k`` classes of images (and logits), one result per readable image; the rest as in ``caption``."""
    return list(iter_classifications(classifier, images, top_k=top_k, batch_size=batch_size,
                                     on_bad_image=on_bad_image, device=device, logits=logits))


def write_classifications(out: str | os.PathLike, results: Sequence[ClassificationResult]) -> Path:
    """Write results as ``vision-attn classify``'s JSON, a list of their ``to_record()``, atomically."""
    return write_json_atomically(output_file(out), [result.to_record() for result in results])


def caption_figure(result: CaptionResult, image: ImageInput | None = None, *, panel_size: int = 224,
                   columns: int = 5, **style: Any) -> Image.Image:
    """The paper's figure of a caption over ``image`` (default: its file); ``style`` goes to ``overlay.heat_panel``."""
    if image is None:
        if not Path(result.source).is_file():
            raise ValueError(f"{result.source}: not an image file; pass the image the caption was made from")
        image = result.source
    shown = open_input(image, "RGB", 2 * panel_size)
    return caption_overlay(shown, result.to_record(), panel_size=panel_size, columns=columns, **style)


def classifier_figure(classifier: Classifier, image: ImageInput, *, head_fusion: HeadFusion = "mean",
                      discard_ratio: float = 0.0, gradient_class: str | int | None = None, panel_size: int = 224,
                      columns: int = 5, **style: Any) -> Image.Image:
    """The ViT's attention over one image, as ``vision-attn overlay`` draws it: rollout, the gradient rollout of
    ``gradient_class`` (a name or an index) if given, the last layer's heads; ``style`` as in ``caption_figure``."""
    index = classifier.class_index(str(gradient_class)) if gradient_class is not None else None
    item = _inputs(image)
    if len(item) != 1:
        raise ValueError(f"{image}: one image is drawn at a time, this names {len(item)}")
    overlays = vit_overlays(classifier, item, head_fusion=head_fusion, discard_ratio=discard_ratio,
                            gradient_class=index, panel_size=panel_size, columns=columns, batch_size=1,
                            opener=_open_item, **style)
    return next(overlays).figure
