"""What every DataModule here shares: one loader recipe per split, and batch normalisation."""

from __future__ import annotations

import lightning as L
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vision_attn.data.images import normalize


class SplitDataModule(L.LightningDataModule):
    """Loaders that differ only in the split and whether it trains; subclasses define ``_loader``.

    Subclasses set ``train_set``/``val_set``/``test_set`` in ``setup`` and ``mean``/``std`` per channel.
    """

    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None
    mean: list[float]
    std: list[float]

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float, (x / 255 - mean) / std."""
        return normalize(images, self.mean, self.std)
