"""Reading image files of any mode into uint8 tensors of the network's input geometry."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor
from torchvision.transforms import v2

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
Image.MAX_IMAGE_PIXELS = 200_000_000  # decompression-bomb guard, well above any real photo


class BadImageError(ValueError):
    """An image file that cannot be decoded; the message names the file."""


def open_image(path: str | os.PathLike, *, mode: str = "RGB", max_side: int | None = None) -> Image.Image:
    """Decode ``path`` upright (EXIF orientation applied) in ``mode`` ("RGB" or "L").

    ``max_side`` lets JPEG decoding skip detail that resizing would throw away, so huge photos do not
    cost their full size in memory.
    """
    try:
        with Image.open(path) as image:
            if max_side and image.format == "JPEG":
                image.draft("RGB" if mode == "RGB" else "L", (max_side, max_side))
            image = ImageOps.exif_transpose(image)
            if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: keep the top 8 bits
                image = image.point(lambda value: value / 256).convert("L")
            if image.mode in ("P", "PA", "RGBA", "LA") and mode == "RGB":
                image = image.convert("RGBA")
                background = Image.new("RGBA", image.size, (0, 0, 0, 255))
                image = Image.alpha_composite(background, image)
            return image.convert(mode)
    except FileNotFoundError:
        raise BadImageError(f"{path}: file not found") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise BadImageError(f"{path}: cannot decode image ({str(error).splitlines()[0]})") from None


def to_tensor(image: Image.Image) -> Tensor:
    """PIL image -> uint8 tensor (C, H, W)."""
    return v2.functional.pil_to_tensor(image)


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
        elif item.exists():
            found.append((item.name, item))
        else:
            raise FileNotFoundError(f"{item}: no such file or folder")
    return found


def eval_transform(image_size: int) -> v2.Compose:
    """Shorter side to ``image_size``, then the centre square."""
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


def train_transform(image_size: int, *, min_scale: float = 0.35) -> v2.Compose:
    """Random-resized crop to a ``image_size`` square."""
    return v2.Compose([v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True)])


class ImageFileDataset(torch.utils.data.Dataset):
    """(image file, label) pairs decoded to uint8 (C, H, W) squares of ``image_size``."""

    def __init__(self, samples: list[tuple[Path, int]], *, image_size: int, in_chans: int, train: bool) -> None:
        self.samples = samples
        self.mode = "L" if in_chans == 1 else "RGB"
        self.max_side = 2 * image_size
        self.transform = train_transform(image_size) if train else eval_transform(image_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        path, label = self.samples[index]
        image = to_tensor(open_image(path, mode=self.mode, max_side=self.max_side))
        return self.transform(image), torch.tensor(label)


def normalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """uint8 images (B, C, H, W) or (C, H, W) -> float (x / 255 - mean) / std, per channel."""
    shape = (-1, 1, 1)
    mean_tensor = torch.tensor(mean, device=images.device).view(shape)
    std_tensor = torch.tensor(std, device=images.device).view(shape)
    return (images.float() / 255.0 - mean_tensor) / std_tensor


def denormalize(images: Tensor, mean: list[float], std: list[float]) -> Tensor:
    """The inverse of ``normalize``: float images -> uint8 (B, C, H, W) or (C, H, W), for drawing."""
    shape = (-1, 1, 1)
    mean_tensor = torch.tensor(mean, device=images.device).view(shape)
    std_tensor = torch.tensor(std, device=images.device).view(shape)
    return ((images.float() * std_tensor + mean_tensor) * 255.0).round().clamp(0, 255).to(torch.uint8)


def to_pil(image: Tensor) -> Image.Image:
    """uint8 (C, H, W) with 1 or 3 channels -> an RGB PIL image."""
    array = image.detach().cpu().permute(1, 2, 0).numpy()
    return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).convert("RGB")
