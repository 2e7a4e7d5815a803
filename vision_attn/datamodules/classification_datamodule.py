"""The base of the classification DataModules, and of those with official train and test splits in memory.
Datasets yield ``(uint8 image (C, H, W), label)``; normalisation and augmentation run on whole batches on the device.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vision_attn.data.classification_datasets import (
    PlacedItems,
    TensorImageDataset,
    collate_readable,
    random_erase,
    random_hflip,
    random_pad_crop,
    split_train_val,
)
from vision_attn.datamodules.data_options import Augmentation
from vision_attn.datamodules.split_datamodule import SplitDataModule
from vision_attn.option_groups import Loader

# The DataModules' defaults where they differ from the groups' own
LOADER = Loader(batch_size=128)
HELD_OUT_LOADER = Loader(batch_size=128, eval_batch_size=1000)  # a whole split of small images in a few batches


class ClassificationDataModule(SplitDataModule):
    """Base for the image classification DataModules; subclasses fill the datasets and metadata. ``loader`` says
    how splits are batched, ``augmentation`` what training batches go through."""

    collate_fns, drop_last = (collate_readable, collate_readable), True
    class_names: list[str]

    def __init__(self, *, loader: Loader = LOADER, augmentation: Augmentation = Augmentation()) -> None:
        super().__init__(Loader.coerce(loader, LOADER))
        self.augmentation = Augmentation.coerce(augmentation)

    @property
    def num_classes(self) -> int:
        """How many classes the labels count, for the CLI to link into the model."""
        return len(self.class_names)

    def predict_dataloader(self) -> DataLoader:
        """The test split, in order, each batch ending with its images' places (``PlacedItems``) to name them."""
        return self._loader(None if self.test_set is None else PlacedItems(self.test_set, "test"), train=False)

    def on_after_batch_transfer(self, batch: tuple[Any, ...] | None, dataloader_idx: int) -> tuple[Any, ...] | None:
        """The batch as the model reads it (``prepare_batch``); a prediction batch keeps its places last."""
        if batch is not None and getattr(self.trainer, "predicting", False):
            *items, places = batch
            return (*self.prepare_batch(tuple(items)), places)
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def prepare_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        """(images, labels) on the device: training batches augmented, every batch normalised."""
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            images = self.augment(images)
        return self.normalize(images), labels

    def augment(self, images: Tensor, *, erase: bool = True) -> Tensor:
        """A training batch (B, C, H, W) uint8 with the configured random shifts, flips and erasing."""
        options = self.augmentation
        if options.pad_crop:
            images = random_pad_crop(images, options.pad_crop)
        if options.hflip:
            images = random_hflip(images)
        if erase and options.erase_prob:
            images = random_erase(images, options.erase_prob)
        return images


class HeldOutValidationDataModule(ClassificationDataModule):
    """A dataset with official train and test splits held in memory; validation is a fixed hold-out of train.

    Args:
        root: where to look for the dataset (after the system location), and where a download goes
        val_size: images of the official train split held out for validation
        split_seed: the seed of that hold-out
        download: fetch the dataset when it is nowhere to be found
    """

    def __init__(self, root: str, *, val_size: int = 5000, split_seed: int = 0, download: bool = True,
                 loader: Loader = HELD_OUT_LOADER, **options: Any) -> None:
        super().__init__(loader=Loader.coerce(loader, HELD_OUT_LOADER), **options)
        self.root, self.val_size, self.split_seed, self.download = root, val_size, split_seed, download

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, C, H, W), labels (N,)) of the official ``train`` or ``test`` split."""
        raise NotImplementedError

    def served(self, dataset: Dataset, role: str) -> Dataset:
        """The dataset the ``role`` split ("train", "val" or "test") is batched from: here the loaded one."""
        return dataset

    def setup(self, stage: str | None = None) -> None:
        """The stage's splits in memory: train and its validation hold-out, or the official test split."""
        if stage in (None, "fit", "validate") and self.train_set is None:
            train, val = split_train_val(TensorImageDataset(*self.load_split("train")), self.val_size, self.split_seed)
            self.train_set, self.val_set = self.served(train, "train"), self.served(val, "val")
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = self.served(TensorImageDataset(*self.load_split("test")), "test")
