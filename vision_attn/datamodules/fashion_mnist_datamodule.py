"""The Fashion-MNIST DataModule: its official splits in memory, a fixed hold-out of train for validation."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from vision_attn.data import fashion_mnist
from vision_attn.datamodules.classification_datamodule import HeldOutValidationDataModule


class FashionMNISTDataModule(HeldOutValidationDataModule):
    """Fashion-MNIST: a fixed hold-out of the training set for validation, the official test set for test.

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
    """

    def __init__(self, root: str = "data/fashion_mnist", **options: Any) -> None:
        super().__init__(root, **options)
        self.class_names, self.in_chans, self.image_size = list(fashion_mnist.CLASS_NAMES), 1, 28
        self.mean, self.std = [fashion_mnist.MEAN], [fashion_mnist.STD]

    def prepare_data(self) -> None:
        """Find Fashion-MNIST, downloading it when it is nowhere to be found and ``download`` allows."""
        fashion_mnist.find_fashion_mnist(self.root, download=self.download)

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, 1, 28, 28), labels (N,)) of the official ``train`` or ``test`` split."""
        images, labels = fashion_mnist.load_fashion_mnist(fashion_mnist.find_fashion_mnist(self.root, download=False),
                                                          split)
        return images.unsqueeze(1), labels  # (N, 28, 28) -> (N, 1, 28, 28)
