"""What every DataModule here shares: one loader recipe per split, and batch normalisation."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from vision_attn.data.images import BadImageCounter, normalize
from vision_attn.option_groups import ImageFormat, Loader

log = logging.getLogger(__name__)


class ResumableRandomSampler(Sampler[int]):
    """Shuffles in an order that depends only on (seed, epoch); ``resume_at = (epoch, items)`` skips that epoch's
    first ``items``, so a resumed run sees the batches an uninterrupted one would (``len`` stays the full epoch)."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0
        self.resume_at: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next iteration in this epoch's order."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.size, generator=generator).tolist()
        skip = self.resume_at[1] if self.resume_at is not None and self.resume_at[0] == self.epoch else 0
        self.resume_at = None
        return iter(order[skip:])


class ShardedEvalSampler(DistributedSampler):
    """Evaluation shards without padding: rank r takes items r, r + W, r + 2W, ..., each item once across the W
    ranks (``DistributedSampler`` pads by repeating items, counting them twice); Lightning uses it as it is."""

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))  # type: ignore[arg-type]


class SplitDataModule(L.LightningDataModule):
    """Loaders that differ only in the split and whether it trains. Subclasses pass their ``loader``, set
    ``collate_fns``, the splits in ``setup``, and ``image_size``, ``in_chans``, ``mean``, ``std`` (``image_format``),
    and define ``prepare_batch(batch)``: a batch on the device as the model reads it."""

    train_set: Dataset | None = None
    val_set: Dataset | None = None
    test_set: Dataset | None = None
    collate_fns: tuple[Callable, Callable]  # how (training, evaluation) batches are put together
    drop_last = False  # drop the last, partial training batch of an epoch that has more than one
    image_size: int
    in_chans: int
    mean: list[float]
    std: list[float]
    # where the training order is, for an exact resume
    _shuffle_seed: int | None = None
    _resume_at: tuple[int, int] | None = None
    _counted_epoch: int = -1
    _batches_this_epoch: int = 0

    def __init__(self, loader: Loader) -> None:
        super().__init__()
        self.loader, self.bad_images = loader, BadImageCounter()

    @property
    def image_format(self) -> ImageFormat:
        """How this data's images reach the model: their size, channels and normalisation."""
        return ImageFormat(size=self.image_size, channels=self.in_chans, mean=list(self.mean), std=list(self.std))

    @property
    def bad_image_options(self) -> dict[str, Any]:
        """The dataset arguments that carry the loader's ``on_bad_image`` policy and the shared counter: "skip"
        leaves unreadable images out, each with a warning, and counts them; "error" stops the run."""
        return {"on_bad_image": self.loader.on_bad_image, "bad_images": self.bad_images}

    def report_skipped(self, what: str) -> int:
        """Log how many unreadable images were skipped since the last report (``what``: e.g. "epoch 3")."""
        skipped = self.bad_images.take()
        if skipped:
            log.warning("%s: skipped %d unreadable image%s (named in the warnings above)", what, skipped,
                        "" if skipped == 1 else "s")
        return skipped

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        """A split's DataLoader; training shuffles resumably from the run's seed, with the loader's own generator (none
        of the global random stream), so a resumed run is bitwise equal to an uninterrupted one."""
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not been run for this stage")
        batch_size = self.loader.batch_size if train else self.loader.eval_size
        sampler: Sampler[int] | None = None
        if not train and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            sampler = ShardedEvalSampler(dataset)
        if train:
            if self._shuffle_seed is None:
                self._shuffle_seed = torch.initial_seed() % (2**31)
            sampler = ResumableRandomSampler(len(dataset), self._shuffle_seed)  # type: ignore[arg-type]
            sampler.resume_at = self._resume_at
        workers = self.loader.num_workers
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                          drop_last=train and self.drop_last and len(dataset) > batch_size,  # type: ignore[arg-type]
                          persistent_workers=workers > 0, pin_memory=self.loader.pin_memory,
                          collate_fn=self.collate_fns[0 if train else 1],
                          generator=torch.Generator().manual_seed(self._shuffle_seed or 0))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The batch as the model reads it (``prepare_batch``), None when every image of it was unreadable and
        skipped; counts the batches trained on, for the checkpoints' place in the training order."""
        if batch is None:
            return None
        trainer = self.trainer
        if trainer is not None and trainer.training:
            if trainer.current_epoch != self._counted_epoch:
                self._counted_epoch, self._batches_this_epoch = trainer.current_epoch, 0
            self._batches_this_epoch += 1
        return self.prepare_batch(batch)

    def prepare_batch(self, batch: Any) -> Any:
        """A batch on the device as the model reads it (normalised; augmented when training)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        """Where in the training order the run is, saved in every checkpoint by Lightning."""
        if self._shuffle_seed is None:
            return {}
        return {"seed": self._shuffle_seed, "epoch": self._counted_epoch, "batches": self._batches_this_epoch,
                "batch_size": self.loader.batch_size}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore the training order's seed and position from a checkpoint, so training resumes at its batch."""
        if not state_dict:
            return
        self._shuffle_seed = int(state_dict["seed"])
        self._resume_at = (int(state_dict["epoch"]), int(state_dict["batches"]) * int(state_dict["batch_size"]))
        self._counted_epoch, self._batches_this_epoch = int(state_dict["epoch"]), int(state_dict["batches"])

    def train_dataloader(self) -> DataLoader:
        """The training split's loader, shuffled in a resumable order."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """The validation split's loader, in order."""
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        """The test split's loader, in order."""
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self) -> DataLoader:
        """Prediction runs over the test split, in order."""
        return self._loader(self.test_set, train=False)

    def normalize(self, images: Tensor) -> Tensor:
        """uint8 (B, C, H, W) -> float, (x / 255 - mean) / std."""
        return normalize(images, self.mean, self.std)
