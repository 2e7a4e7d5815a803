"""The shape shared by the classification DataModules (Fashion-MNIST, CIFAR-10, ImageFolder).

Datasets yield ``(uint8 image (C, H, W), label)``. Normalisation and the cheap augmentations (random
crop with padding, horizontal flip) run on whole batches after they reach the device, in
``on_after_batch_transfer``: one vectorised op per batch instead of Python per sample, on the GPU when
there is one. ``num_classes``, ``class_names``, ``in_chans``, ``image_size``, ``mean`` and ``std`` are
known right after construction, so LightningCLI links them into the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from vision_attn.data.base import SplitDataModule
from vision_attn.data.images import collate_readable


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


def random_pad_crop(images: Tensor, padding: int, generator: torch.Generator | None = None) -> Tensor:
    """Per-image random crop of the zero-padded batch (B, C, H, W) back to (H, W)."""
    batch, _, height, width = images.shape
    padded = F.pad(images, (padding,) * 4)  # (B, C, H + 2p, W + 2p)
    shape = (batch,)
    top = torch.randint(0, 2 * padding + 1, shape, device=images.device, generator=generator)
    left = torch.randint(0, 2 * padding + 1, shape, device=images.device, generator=generator)
    rows = (top[:, None] + torch.arange(height, device=images.device))[:, None, :, None]  # (B, 1, H, 1)
    cols = (left[:, None] + torch.arange(width, device=images.device))[:, None, None, :]  # (B, 1, 1, W)
    batch_index = torch.arange(batch, device=images.device)[:, None, None, None]
    channel_index = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    return padded[batch_index, channel_index, rows, cols]


def random_hflip(images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Flip a random half of the batch (B, C, H, W) left-right."""
    flip = torch.rand(images.shape[0], device=images.device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def random_erase(images: Tensor, probability: float, generator: torch.Generator | None = None,
                 area: tuple[float, float] = (0.02, 0.33), log_aspect: float = 1.2) -> Tensor:
    """Random Erasing (Zhong et al. 2017): with ``probability``, blank one rectangle per image (B, C, H, W).

    The rectangle covers a uniform fraction ``area`` of the image with an aspect ratio drawn log-uniformly
    from [e^-log_aspect, e^log_aspect] (about 0.3 to 3.3, the paper's setting), clipped to the image, and
    is filled with zeros (black, Fashion-MNIST's background).
    """
    batch, _, height, width = images.shape
    device = images.device

    def uniform(low: float, high: float) -> Tensor:
        return low + (high - low) * torch.rand(batch, device=device, generator=generator)

    target = uniform(*area) * height * width
    aspect = torch.exp(uniform(-log_aspect, log_aspect))
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


class ClassificationDataModule(SplitDataModule):
    """Base for the image classification DataModules; subclasses fill the datasets and metadata."""

    def __init__(
        self,
        *,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        pad_crop: int = 0,
        hflip: bool = False,
        erase_prob: float = 0.0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if pad_crop < 0:
            raise ValueError(f"pad_crop must be 0 or more pixels, got {pad_crop}")
        if not 0.0 <= erase_prob <= 1.0:
            raise ValueError(f"erase_prob must be between 0 and 1, got {erase_prob}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.pad_crop = pad_crop
        self.hflip = hflip
        self.erase_prob = erase_prob
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.class_names: list[str] = []
        self.in_chans: int = 3
        self.image_size: int = 32
        self.mean: list[float] = [0.5] * 3
        self.std: list[float] = [0.5] * 3

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        return self._make_loader(
            dataset,
            train=train,
            batch_size=self.batch_size if train else self.eval_batch_size,
            num_workers=self.num_workers,
            collate_fn=collate_readable,
            drop_last=train and dataset is not None and len(dataset) > self.batch_size,  # type: ignore[arg-type]
            pin_memory=self.pin_memory,
        )

    def on_after_batch_transfer(self, batch: tuple[Tensor, Tensor] | None,
                                dataloader_idx: int) -> tuple[Tensor, Tensor] | None:
        if batch is None:  # every image of the batch was unreadable and skipped
            return None
        self.count_train_batch()
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            if self.pad_crop:
                images = random_pad_crop(images, self.pad_crop)
            if self.hflip:
                images = random_hflip(images)
            if self.erase_prob:
                images = random_erase(images, self.erase_prob)
        return self.normalize(images), labels


class HeldOutValidationDataModule(ClassificationDataModule):
    """A dataset with official train and test splits held in memory; validation is a fixed hold-out of train.

    Subclasses say how to read a split (``load_split``); the splitting and loaders are shared.
    """

    def __init__(self, root: str, *, val_size: int, split_seed: int, download: bool, **loader_options) -> None:
        super().__init__(**loader_options)
        self.root = root
        self.val_size = val_size
        self.split_seed = split_seed
        self.download = download

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, C, H, W), labels (N,)) of the official ``train`` or ``test`` split."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit", "validate") and self.train_set is None:
            full = TensorImageDataset(*self.load_split("train"))
            self.train_set, self.val_set = split_train_val(full, self.val_size, self.split_seed)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = TensorImageDataset(*self.load_split("test"))


def split_train_val(dataset: Dataset, val_size: int, seed: int) -> tuple[Subset, Subset]:
    """A fixed random hold-out of ``val_size`` items; the rest is for training."""
    if not 0 < val_size < len(dataset):  # type: ignore[arg-type]
        raise ValueError(f"val_size must be between 1 and {len(dataset) - 1}, got {val_size}")  # type: ignore[arg-type]
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()  # type: ignore[arg-type]
    return Subset(dataset, order[val_size:]), Subset(dataset, order[:val_size])

