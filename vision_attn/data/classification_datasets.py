"""Image classification data without Lightning: datasets of ``(uint8 image (C, H, W), label)``, the augmentations
that run on whole batches on the device, the transforms, the hold-out split and ``root/<split>/<class>/`` scanning.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, Subset
from torchvision.transforms import v2

from vision_attn.data.images import BadImageCounter, OnBadImage, list_images, load_or_skip, open_image, to_tensor
from vision_attn.errors import DatasetNotFoundError

ERASE_AREA, ERASE_LOG_ASPECT = (0.02, 0.33), 1.2  # Random Erasing's shares of the image, and aspects 0.3 to 3.3


class TensorImageDataset(Dataset):
    """Images held in memory as one uint8 tensor (N, C, H, W) with integer labels (N,)."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        if images.ndim != 4 or images.dtype != torch.uint8:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels.long()

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.images[index], self.labels[index]


def random_pad_crop(images: Tensor, padding: int) -> Tensor:
    """Per-image random crop of the zero-padded batch (B, C, H, W) back to (H, W)."""
    batch, _, height, width = images.shape
    padded = F.pad(images, (padding,) * 4)  # (B, C, H + 2p, W + 2p)
    top = torch.randint(0, 2 * padding + 1, (batch,), device=images.device)
    left = torch.randint(0, 2 * padding + 1, (batch,), device=images.device)
    windows = padded.unfold(2, height, 1).unfold(3, width, 1)  # (B, C, 2p + 1, 2p + 1, H, W), a view
    return windows[torch.arange(batch, device=images.device), :, top, left]


def random_hflip(images: Tensor) -> Tensor:
    """Flip a random half of the batch (B, C, H, W) left-right."""
    flip = torch.rand(images.shape[0], device=images.device) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def random_erase(images: Tensor, probability: float, generator: torch.Generator | None = None) -> Tensor:
    """Random Erasing (Zhong et al. 2017): with ``probability``, zero one rectangle per image (B, C, H, W), of a
    uniform share ``ERASE_AREA`` of it and a log-uniform aspect within e^±``ERASE_LOG_ASPECT`` (the paper's)."""
    batch, _, height, width = images.shape
    device = images.device

    def uniform(low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(batch, device=device, generator=generator)

    target = uniform(*ERASE_AREA) * height * width
    aspect = torch.exp(uniform(-ERASE_LOG_ASPECT, ERASE_LOG_ASPECT))
    box_h = (target * aspect).sqrt().round().clamp(1, height)
    box_w = (target / aspect).sqrt().round().clamp(1, width)
    top = (uniform(0.0, 1.0) * (height - box_h + 1)).floor()
    left = (uniform(0.0, 1.0) * (width - box_w + 1)).floor()
    rows = torch.arange(height, device=device)[None, :]  # (1, H)
    cols = torch.arange(width, device=device)[None, :]  # (1, W)
    in_rows = (rows >= top[:, None]) & (rows < (top + box_h)[:, None])  # (B, H)
    in_cols = (cols >= left[:, None]) & (cols < (left + box_w)[:, None])  # (B, W)
    chosen = torch.rand(batch, device=device, generator=generator) < probability
    erase = in_rows[:, :, None] & in_cols[:, None, :] & chosen[:, None, None]  # (B, H, W)
    return images.masked_fill(erase[:, None], 0)


def eval_transform(image_size: int) -> v2.Compose:
    """Shorter side to ``image_size``, then the centre square."""
    return v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])


class ImageFileDataset(torch.utils.data.Dataset):
    """(image file, label) pairs as uint8 (C, H, W) squares: a random-resized crop in training, else the centre."""

    def __init__(self, samples: list[tuple[Path, int]], *, image_size: int, in_chans: int, train: bool,
                 on_bad_image: OnBadImage = "skip", bad_images: BadImageCounter | None = None) -> None:
        self.samples = samples
        self.mode = "L" if in_chans == 1 else "RGB"
        self.max_side = 2 * image_size
        self.transform = v2.RandomResizedCrop(image_size, scale=(0.35, 1.0), antialias=True) if train \
            else eval_transform(image_size)
        self.on_bad_image, self.bad_images = on_bad_image, bad_images

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor] | None:
        """(image, label), or None for an unreadable image under the "skip" policy (the collate drops it)."""
        path, label = self.samples[index]
        image = load_or_skip(lambda: to_tensor(open_image(path, mode=self.mode, max_side=self.max_side)),
                             self.on_bad_image, self.bad_images)
        return None if image is None else (self.transform(image), torch.tensor(label))


def collate_readable(items: list[tuple[Tensor, Tensor] | None]) -> tuple[Tensor, Tensor] | None:
    """Stack the items that were read; None when every image of the batch was skipped."""
    kept = [item for item in items if item is not None]
    return torch.utils.data.default_collate(kept) if kept else None


class PlacedItems(Dataset):
    """A split's items for prediction, each followed by ``(index, name)``, its place in the split (an unreadable
    image stays None, so every prediction keeps its own image's place)."""

    def __init__(self, dataset: Dataset, split: str) -> None:
        self.dataset, self.split = dataset, split

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def name(self, index: int) -> str:
        """The name of the item at ``index``: its file, else ``<split>/<index>``."""
        dataset, inner = self.dataset, index
        while isinstance(dataset, Subset):
            dataset, inner = dataset.dataset, dataset.indices[inner]
        samples = getattr(dataset, "samples", None)
        return str(samples[inner][0]) if isinstance(samples, list) else f"{self.split}/{index}"

    def __getitem__(self, index: int) -> tuple[Tensor, ...] | None:
        item = self.dataset[index]
        return None if item is None else (*item, (index, self.name(index)))


def split_train_val(dataset: Dataset, val_size: int, seed: int) -> tuple[Subset, Subset]:
    """A fixed random hold-out of ``val_size`` items; the rest is for training."""
    if not 0 < val_size < len(dataset):  # type: ignore[arg-type]
        raise ValueError(f"val_size must be between 1 and {len(dataset) - 1}, got {val_size}")  # type: ignore[arg-type]
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()  # type: ignore[arg-type]
    return Subset(dataset, order[val_size:]), Subset(dataset, order[:val_size])


def scan_split(split_dir: Path, class_names: list[str]) -> list[tuple[Path, int]]:
    """(path, label) for every image in ``split_dir/<class>/``; classes must be among ``class_names``."""
    samples: list[tuple[Path, int]] = []
    for class_dir in sorted(d for d in split_dir.iterdir() if d.is_dir()):
        if class_dir.name not in class_names:
            raise ValueError(f"{class_dir}: class '{class_dir.name}' is not in the train split's classes")
        samples += [(path, class_names.index(class_dir.name)) for path in list_images(class_dir)]
    if not samples:
        raise DatasetNotFoundError(f"{split_dir}: no images found in its class folders")
    return samples
