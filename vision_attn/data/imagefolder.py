"""Any image classification set laid out as ``root/<split>/<class name>/<image>`` (torchvision's layout)."""

from __future__ import annotations

import logging
from pathlib import Path

from vision_attn.data.classification import ClassificationDataModule, split_train_val
from vision_attn.data.fashion_mnist import DatasetNotFoundError
from vision_attn.data.images import ImageFileDataset, OnBadImage, list_images

log = logging.getLogger(__name__)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


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


class ImageFolderDataModule(ClassificationDataModule):
    """``root/train/<class>/*`` (required), ``root/val/...`` (else a hold-out of train), ``root/test/...``.

    Class names are the train split's folder names, sorted; the test split falls back to val.
    ``on_bad_image="skip"`` leaves unreadable images out, each named in a warning and counted per epoch.
    """

    def __init__(
        self,
        root: str,
        *,
        image_size: int = 224,
        in_chans: int = 3,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        random_resized_crop: bool = True,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 2,
        hflip: bool = True,
        erase_prob: float = 0.0,
        pin_memory: bool = False,
        on_bad_image: OnBadImage = "skip",
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            num_workers=num_workers,
            hflip=hflip,
            erase_prob=erase_prob,
            pin_memory=pin_memory,
        )
        self.set_bad_image_policy(on_bad_image)
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        self.root = Path(root)
        train_dir = self.root / "train"
        if not train_dir.is_dir():
            raise DatasetNotFoundError(f"{train_dir}: missing; expected {self.root}/train/<class>/<image> folders")
        self.class_names = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
        if not self.class_names:
            raise DatasetNotFoundError(f"{train_dir}: no class folders")
        self.image_size = image_size
        self.in_chans = in_chans
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.random_resized_crop = random_resized_crop
        default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if in_chans == 3 else ([0.5], [0.5])
        self.mean, self.std = mean or default_mean, std or default_std
        if len(self.mean) != in_chans or len(self.std) != in_chans:
            raise ValueError(f"mean and std need {in_chans} values each, got {self.mean} and {self.std}")

    def _dataset(self, samples: list[tuple[Path, int]], *, train: bool) -> ImageFileDataset:
        return ImageFileDataset(
            samples, image_size=self.image_size, in_chans=self.in_chans, train=train and self.random_resized_crop,
            **self.bad_image_options,
        )

    def setup(self, stage: str | None = None) -> None:
        train_samples = scan_split(self.root / "train", self.class_names)
        val_dir, test_dir = self.root / "val", self.root / "test"
        if val_dir.is_dir():
            self.train_set = self._dataset(train_samples, train=True)
            self.val_set = self._dataset(scan_split(val_dir, self.class_names), train=False)
        else:
            val_size = max(1, round(self.val_fraction * len(train_samples)))
            train_part, val_part = split_train_val(train_samples, val_size, self.split_seed)  # type: ignore[arg-type]
            self.train_set = self._dataset(list(train_part), train=True)
            self.val_set = self._dataset(list(val_part), train=False)
            log.info("no %s: holding out %d of %d train images for validation", val_dir, val_size,
                     len(train_samples))
        if test_dir.is_dir():
            self.test_set = self._dataset(scan_split(test_dir, self.class_names), train=False)
        else:
            self.test_set = self.val_set
