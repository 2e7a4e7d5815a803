"""The CIFAR-10 DataModule: its official splits in memory, a fixed hold-out of train for validation."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from vision_attn.data import cifar10
from vision_attn.datamodules.classification_datamodule import HeldOutValidationDataModule
from vision_attn.datamodules.data_options import Augmentation

CIFAR10_AUGMENTATION = Augmentation(pad_crop=4, hflip=True)  # its default: random shifts and flips


class CIFAR10DataModule(HeldOutValidationDataModule):
    """CIFAR-10: a fixed hold-out of the training set for validation, the official test set for test, with
    random shifts and flips by default.

    Args:
        root: where CIFAR-10 is (either release), or where a download goes
    """

    def __init__(self, root: str = "data/cifar10", *, augmentation: Augmentation = CIFAR10_AUGMENTATION,
                 **options: Any) -> None:
        super().__init__(root, augmentation=Augmentation.coerce(augmentation, CIFAR10_AUGMENTATION), **options)
        self.class_names, self.in_chans, self.image_size = list(cifar10.CLASS_NAMES), 3, 32
        self.mean, self.std = list(cifar10.MEAN), list(cifar10.STD)

    def prepare_data(self) -> None:
        """Find CIFAR-10 under ``root``, downloading it there when missing and ``download`` allows."""
        cifar10.load_cifar10(self.root, "test", download=self.download)

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, 3, 32, 32), labels (N,)) of the official ``train`` or ``test`` split."""
        return cifar10.load_cifar10(self.root, split)
