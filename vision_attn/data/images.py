"""Reading image files of any mode into uint8 tensors, and the per-channel normalisation of both models (without
torchvision, so that the inference commands do not pay for its import)."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor

from vision_attn.errors import BadImageError

log = logging.getLogger(__name__)

Loaded = TypeVar("Loaded")
Item = TypeVar("Item")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# The largest image decoded, above a 100 MP camera's: one that claims more is refused from its header.
MAX_PIXELS = 120_000_000
Image.MAX_IMAGE_PIXELS = 2 * MAX_PIXELS  # Pillow's own guard, behind ours: it refuses above twice that
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
OnBadImage = Literal["skip", "error"]


class BadImageCounter:
    """Counts images skipped as unreadable, each DataLoader worker in its own slot of a shared-memory tensor."""

    SLOTS = 257  # the main process + up to 256 workers

    def __init__(self) -> None:
        self.counts = torch.zeros(self.SLOTS, dtype=torch.int64).share_memory_()
        self._reported = 0

    def add(self) -> None:
        """Count one skipped image, in this process's slot."""
        worker = torch.utils.data.get_worker_info()
        self.counts[0 if worker is None else 1 + worker.id % (self.SLOTS - 1)] += 1

    def skipped_note(self) -> str:
        """" (N unreadable images skipped)" when any were, else "": the end of a command's summary line."""
        total = int(self.counts.sum())  # in every process
        return f" ({total} unreadable images skipped)" if total else ""

    def take(self) -> int:
        """The images skipped since the last ``take()``."""
        total = int(self.counts.sum())
        new, self._reported = total - self._reported, total
        return new


def load_or_skip(load: Callable[[], Loaded], policy: OnBadImage, counter: BadImageCounter | None) -> Loaded | None:
    """``load()``, or, for an unreadable image under the "skip" policy, None with a logged warning and a count."""
    try:
        return load()
    except BadImageError as error:
        if policy == "error":
            raise
        log.warning("skipped an unreadable image: %s", error)
        if counter is not None:
            counter.add()
        return None


def readable_batches(items: Sequence[Item], load: Callable[[Item], Tensor], *, batch_size: int,
                     on_bad_image: OnBadImage = "error",
                     bad_images: BadImageCounter | None = None) -> Iterator[tuple[list[Item], Tensor]]:
    """``items`` in chunks of ``batch_size``: (the items that loaded, their tensors stacked), for inference."""
    for start in range(0, len(items), batch_size):
        loaded = [(item, load_or_skip(lambda item=item: load(item), on_bad_image, bad_images))
                  for item in items[start : start + batch_size]]
        kept = [(item, tensor) for item, tensor in loaded if tensor is not None]
        if kept:
            yield [item for item, _ in kept], torch.stack([tensor for _, tensor in kept])


def open_image(path: str | os.PathLike, *, mode: str = "RGB", max_side: int | None = None) -> Image.Image:
    """Decode ``path`` upright (EXIF) in ``mode`` ("RGB" or "L"); ``max_side`` lets a JPEG decode at a lower scale."""
    if os.path.exists(path) and not os.path.isfile(path):  # a pipe would block the decoder forever
        what = "a folder" if os.path.isdir(path) else "a pipe or a device?"
        raise BadImageError(f"{path}: not a regular file ({what}), so not an image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # ours is the one message
            opened = Image.open(path)  # the header only
        with opened as image:
            if image.width * image.height > MAX_PIXELS:
                raise BadImageError(f"{path}: {image.width}×{image.height} pixels is more than the "
                                    f"{MAX_PIXELS // 1_000_000}-megapixel limit; refused before decoding")
            if max_side and image.format == "JPEG":
                image.draft("RGB" if mode == "RGB" else "L", (max_side, max_side))
            image = ImageOps.exif_transpose(image)
            if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: keep the top 8 bits
                image = image.point(lambda value: value / 256).convert("L")
            if image.mode in ("P", "PA", "RGBA", "LA") and mode == "RGB":  # over black
                image = Image.alpha_composite(Image.new("RGBA", image.size, (0, 0, 0, 255)), image.convert("RGBA"))
            return image.convert(mode)
    except FileNotFoundError:
        raise BadImageError(f"{path}: file not found") from None
    except Image.DecompressionBombError:  # over 4 × MAX_PIXELS: Pillow refused in Image.open, before we saw it
        raise BadImageError(f"{path}: over {2 * Image.MAX_IMAGE_PIXELS:,} pixels is more than the "
                            f"{MAX_PIXELS // 1_000_000}-megapixel limit; refused before decoding") from None
    except BadImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise BadImageError(f"{path}: cannot decode image ({str(error).splitlines()[0]})") from None


def to_tensor(image: Image.Image) -> Tensor:
    """PIL image -> uint8 tensor (C, H, W), as torchvision's ``pil_to_tensor``."""
    array = np.array(image, copy=True)
    return torch.from_numpy(array.reshape(image.height, image.width, -1)).permute(2, 0, 1)


def list_images(folder: Path) -> list[Path]:
    """Image files directly inside ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[tuple[str, Path]]:
    """(image id, path) for image files and the images directly inside folders; the id is the file name."""
    found: list[tuple[str, Path]] = []
    for item in map(Path, inputs):
        if item.is_dir():
            images = list_images(item)
            if not images:
                raise FileNotFoundError(f"{item}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in this folder")
            found += [(path.name, path) for path in images]
        elif item.is_file():
            found.append((item.name, item))
        elif item.exists():
            raise ValueError(f"{item}: not a regular file (a pipe or a device?), so not an image")
        elif any(parent.is_file() for parent in item.parents):
            raise FileNotFoundError(f"{item}: no such file (a folder on its path is a file)")
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    return found


def _per_channel(values: list[float], images: Tensor) -> Tensor:
    return torch.tensor(values, device=images.device).view(-1, 1, 1)  # (C, 1, 1)


def normalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """uint8 images (B, C, H, W) or (C, H, W) -> float (x / 255 - mean) / std, per channel."""
    return (images.float() / 255.0 - _per_channel(mean, images)) / _per_channel(std, images)


def denormalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """The inverse of ``normalize``: float images -> uint8 (B, C, H, W) or (C, H, W), for drawing."""
    restored = (images.float() * _per_channel(std, images) + _per_channel(mean, images)) * 255.0
    return restored.round().clamp(0, 255).to(torch.uint8)


def to_pil(image: Tensor) -> Image.Image:
    """uint8 (C, H, W) with 1 or 3 channels -> an RGB PIL image."""
    array = image.detach().cpu().permute(1, 2, 0).numpy()
    return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).convert("RGB")
