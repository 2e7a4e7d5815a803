"""The DataModule of any ``root/<split>/<class>/<image>`` tree of image files."""

from __future__ import annotations

import logging
from pathlib import Path

from vision_attn.data.classification_datasets import ImageFileDataset, scan_split, split_train_val
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.datamodules.classification_datamodule import ClassificationDataModule
from vision_attn.datamodules.data_options import Augmentation
from vision_attn.errors import DatasetNotFoundError
from vision_attn.option_groups import Loader

log = logging.getLogger(__name__)
# Its defaults where they differ from the groups' own
IMAGE_FOLDER_LOADER, IMAGE_FOLDER_AUGMENTATION = Loader(batch_size=64, num_workers=2), Augmentation(hflip=True)


class ImageFolderDataModule(ClassificationDataModule):
    """``root/train/<class>/*`` (required), ``root/val/...`` (else a hold-out of train), ``root/test/...`` (else val).

    Args:
        root: the folder holding train/ (and val/, test/), one subfolder per class
        image_size: images are resized to squares of this many pixels
        in_chans: 3 (RGB) or 1 (grey)
        val_fraction: without a val/ folder, this share of train/ is held out for validation
        split_seed: the seed of that hold-out
        random_resized_crop: training images are random resized crops (else resized whole, as in evaluation)
        mean: per-channel mean the images are normalised with (null: ImageNet's for RGB, 0.5 for grey)
        std: per-channel standard deviation (null: ImageNet's for RGB, 0.5 for grey)
    """

    def __init__(self, root: str, *, image_size: int = 224, in_chans: int = 3, val_fraction: float = 0.1,
                 split_seed: int = 0, random_resized_crop: bool = True, mean: list[float] | None = None,
                 std: list[float] | None = None, loader: Loader = IMAGE_FOLDER_LOADER,
                 augmentation: Augmentation = IMAGE_FOLDER_AUGMENTATION) -> None:
        super().__init__(loader=Loader.coerce(loader, IMAGE_FOLDER_LOADER),
                         augmentation=Augmentation.coerce(augmentation, IMAGE_FOLDER_AUGMENTATION))
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        self.root = Path(root)
        train_dir = self.root / "train"
        if not train_dir.is_dir():
            raise DatasetNotFoundError(f"{train_dir}: missing; expected {self.root}/train/<class>/<image> folders")
        self.class_names = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
        if not self.class_names:
            raise DatasetNotFoundError(f"{train_dir}: no class folders")
        self.image_size, self.in_chans, self.random_resized_crop = image_size, in_chans, random_resized_crop
        self.val_fraction, self.split_seed = val_fraction, split_seed
        default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if in_chans == 3 else ([0.5], [0.5])
        self.mean, self.std = mean or default_mean, std or default_std
        if len(self.mean) != in_chans or len(self.std) != in_chans:
            raise ValueError(f"mean and std need {in_chans} values each, got {self.mean} and {self.std}")

    def _dataset(self, samples: list[tuple[Path, int]], *, train: bool) -> ImageFileDataset:
        return ImageFileDataset(samples, image_size=self.image_size, in_chans=self.in_chans,
                                train=train and self.random_resized_crop, **self.bad_image_options)

    def setup(self, stage: str | None = None) -> None:
        """The image files of every split: val/ or a hold-out of train/, test/ or else the validation set."""
        train_samples = scan_split(self.root / "train", self.class_names)
        val_dir, test_dir = self.root / "val", self.root / "test"
        if val_dir.is_dir():
            train_part, val_part = train_samples, scan_split(val_dir, self.class_names)
        else:
            val_size = max(1, round(self.val_fraction * len(train_samples)))
            train_part, val_part = split_train_val(train_samples, val_size, self.split_seed)  # type: ignore[arg-type]
            log.info("no %s: holding out %d of %d train images for validation", val_dir, val_size,
                     len(train_samples))
        self.train_set = self._dataset(list(train_part), train=True)
        self.val_set = self._dataset(list(val_part), train=False)
        self.test_set = self._dataset(scan_split(test_dir, self.class_names), train=False) if test_dir.is_dir() \
            else self.val_set
