"""CIFAR-10 (Krizhevsky 2009): 60k 32×32 colour images of 10 classes, from its binary or python release (read by
an unpickler that accepts only arrays and plain types, so a tampered file cannot run code), or downloaded."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vision_attn.errors import DatasetNotFoundError

CLASS_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
RECORD_BYTES = 1 + 3 * 32 * 32


class _ArraysOnlyUnpickler(pickle.Unpickler):
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
               ("numpy._core.multiarray", "_reconstruct")}

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's own signature
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


def _read_binary_batch(path: Path) -> tuple[Tensor, Tensor]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % RECORD_BYTES:
        raise ValueError(f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records")
    records = raw.reshape(-1, RECORD_BYTES)
    images = torch.from_numpy(records[:, 1:].copy()).reshape(-1, 3, 32, 32)  # (N, C, H, W)
    return images, torch.from_numpy(records[:, 0].astype(np.int64))


def _read_python_batch(path: Path) -> tuple[Tensor, Tensor]:
    try:
        with open(path, "rb") as file:
            batch = _ArraysOnlyUnpickler(file, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ValueError(f"{path}: not a CIFAR-10 batch ({error})") from None
    if not isinstance(batch, dict) or "data" not in batch or "labels" not in batch:
        raise ValueError(f"{path}: not a CIFAR-10 batch (no 'data' and 'labels')")
    images = torch.from_numpy(np.asarray(batch["data"], dtype=np.uint8)).reshape(-1, 3, 32, 32)
    return images, torch.as_tensor(batch["labels"], dtype=torch.int64)


def load_cifar10(root: str | Path, split: str, *, download: bool = False) -> tuple[Tensor, Tensor]:
    """(images uint8 (N, 3, 32, 32), labels (N,)) of the ``train`` or ``test`` split."""
    root = Path(root)
    names = [f"data_batch_{i}" for i in range(1, 6)] if split == "train" else ["test_batch"]
    binary, python = root / "cifar-10-batches-bin", root / "cifar-10-batches-py"
    if not any(d.is_dir() for d in (binary, python)) and download:
        from torchvision.datasets import CIFAR10
        try:
            CIFAR10(str(root), train=True, download=True)
        except Exception as error:  # noqa: BLE001 - any network failure means "not there"
            raise DatasetNotFoundError(f"CIFAR-10 not found under {root} (cifar-10-batches-bin or cifar-10-batches-py) "
                                       f"and the download failed ({str(error).splitlines()[0]})") from None
    if binary.is_dir():
        parts = [_read_binary_batch(binary / f"{name}.bin") for name in names]
    elif python.is_dir():
        parts = [_read_python_batch(python / name) for name in names]
    else:
        raise DatasetNotFoundError(f"CIFAR-10 not found under {root}: expected cifar-10-batches-bin/ or "
                                   "cifar-10-batches-py/ (or set download: true)")
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
