"""Classification DataModules on real Fashion-MNIST and on tiny CIFAR-10 / ImageFolder sets written here."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn.data import fashion_mnist as fmnist
from vision_attn.data.classification_datasets import random_erase, random_hflip, random_pad_crop
from vision_attn.data.fashion_mnist import find_fashion_mnist, read_idx
from vision_attn.datamodules import CIFAR10DataModule, FashionMNISTDataModule, ImageFolderDataModule
from vision_attn.errors import DatasetNotFoundError


class _FakeTrainer:
    """Stands in for the trainer's ``training`` flag and epoch that ``on_after_batch_transfer`` reads."""

    def __init__(self, training: bool) -> None:
        self.training = training
        self.current_epoch = 0


def _transfer(datamodule, batch, *, training: bool):
    datamodule.trainer = _FakeTrainer(training)
    return datamodule.on_after_batch_transfer(batch, 0)


def test_fashion_mnist_splits_and_batches() -> None:
    dm = FashionMNISTDataModule(val_size=5000, loader={"batch_size": 64})
    assert (dm.num_classes, dm.in_chans, dm.image_size) == (10, 1, 28)  # known before setup, for CLI links
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (55000, 5000, 10000)
    assert not set(dm.train_set.indices) & set(dm.val_set.indices)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (64, 1, 28, 28) and images.dtype == torch.uint8
    assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() <= 9
    normalised, _ = _transfer(dm, (images, labels), training=False)
    expected = (images.float() / 255 - fmnist.MEAN) / fmnist.STD
    assert torch.allclose(normalised, expected)
    test_labels = torch.cat([batch[1] for batch in dm.test_dataloader()])
    assert torch.bincount(test_labels).tolist() == [1000] * 10  # the official balanced test set


def test_augmentation_runs_in_training_only() -> None:
    dm = FashionMNISTDataModule(augmentation={"pad_crop": 3, "hflip": True})
    dm.setup("test")
    images, labels = next(iter(dm.test_dataloader()))
    torch.manual_seed(0)
    train_view, _ = _transfer(dm, (images, labels), training=True)
    eval_view, _ = _transfer(dm, (images, labels), training=False)
    assert not torch.equal(train_view, eval_view)
    assert torch.equal(eval_view, dm.normalize(images))


def test_pad_crop_and_flip_move_pixels_as_specified() -> None:
    image = torch.zeros(1, 1, 5, 5)
    image[0, 0, 2, 2] = 1.0
    crops = torch.cat([random_pad_crop(image, 1) for _ in range(200)])
    centres = {tuple((c[0] == 1).nonzero()[0].tolist()) for c in crops}
    assert centres == {(r, c) for r in (1, 2, 3) for c in (1, 2, 3)}  # every shift of at most one pixel
    ramp = torch.arange(4.0).view(1, 1, 1, 4).repeat(100, 1, 1, 1)
    flipped = random_hflip(ramp)
    assert {tuple(row[0, 0].tolist()) for row in flipped} == {(0, 1, 2, 3), (3, 2, 1, 0)}


def test_random_erase_blanks_one_rectangle_in_the_chosen_share_of_images() -> None:
    images = torch.full((2000, 1, 28, 28), 200, dtype=torch.uint8)
    erased = random_erase(images, 0.5, generator=torch.Generator().manual_seed(0))
    blank = erased[:, 0] == 0  # (B, H, W)
    touched = blank.flatten(1).any(dim=1)
    assert 0.45 < touched.float().mean() < 0.55
    for mask in blank[touched][:200]:
        rows, cols = mask.any(dim=1).nonzero().flatten(), mask.any(dim=0).nonzero().flatten()
        height, width = len(rows), len(cols)
        assert int(mask.sum()) == height * width  # one solid rectangle
        assert rows.max() - rows.min() + 1 == height and cols.max() - cols.min() + 1 == width
        assert 0.02 * 784 * 0.5 <= height * width <= 0.34 * 784 * 1.2  # the area range, up to rounding
    assert torch.equal(erased[~touched], images[~touched])
    with pytest.raises(ValueError, match="erase_prob"):
        FashionMNISTDataModule(augmentation={"erase_prob": 1.5})


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as file:
        file.write(header + array.astype(np.uint8).tobytes())


def _write_fake_fashion_mnist(directory: Path, n: int = 20) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for images, labels in fmnist.FILES.values():
        _write_idx(directory / images, rng.integers(0, 256, (n, 28, 28)))
        _write_idx(directory / labels, np.arange(n) % 10)


def test_configured_root_is_used_when_the_system_copy_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(fmnist, "SYSTEM_DIR", tmp_path / "absent")
    _write_fake_fashion_mnist(tmp_path / "root")
    assert find_fashion_mnist(tmp_path / "root", download=False) == tmp_path / "root"
    dm = FashionMNISTDataModule(str(tmp_path / "root"), val_size=5, download=False)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (15, 5)


def test_missing_dataset_error_names_all_three_places(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(fmnist, "SYSTEM_DIR", tmp_path / "absent")
    with pytest.raises(DatasetNotFoundError) as error:
        find_fashion_mnist(tmp_path / "empty", download=False)
    message = str(error.value)
    assert str(tmp_path / "absent") in message and str(tmp_path / "empty") in message and "download" in message


def test_truncated_idx_file_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "bad-idx3-ubyte.gz"
    _write_idx(path, np.zeros((4, 28, 28)))
    data = gzip.open(path).read()[:-10]
    with gzip.open(path, "wb") as file:
        file.write(data)
    with pytest.raises(ValueError, match="header says"):
        read_idx(path)


def _write_cifar(root: Path, *, binary: bool, per_batch: int = 6) -> None:
    rng = np.random.default_rng(0)
    folder = root / ("cifar-10-batches-bin" if binary else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = rng.integers(0, 10, per_batch)
        pixels = rng.integers(0, 256, (per_batch, 3072)).astype(np.uint8)
        if binary:
            records = np.concatenate([labels[:, None].astype(np.uint8), pixels], axis=1)
            records.tofile(folder / f"{name}.bin")
        else:
            with open(folder / name, "wb") as file:
                pickle.dump({"data": pixels, "labels": labels.tolist()}, file)


@pytest.mark.parametrize("binary", [True, False])
def test_cifar10_reads_both_releases(tmp_path, binary) -> None:
    _write_cifar(tmp_path, binary=binary)
    dm = CIFAR10DataModule(str(tmp_path), val_size=6, download=False, loader={"batch_size": 4})
    assert (dm.num_classes, dm.in_chans, dm.image_size) == (10, 3, 32)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (24, 6, 6)
    images, _ = next(iter(dm.train_dataloader()))
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8


class _Exploit:
    def __reduce__(self):
        return (eval, ("1+1",))


def test_cifar10_python_batches_cannot_run_code(tmp_path) -> None:
    _write_cifar(tmp_path, binary=False)
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as file:
        pickle.dump({"data": _Exploit(), "labels": [0]}, file)
    dm = CIFAR10DataModule(str(tmp_path), val_size=6, download=False)
    with pytest.raises(ValueError, match="refused to load builtins.eval"):
        dm.setup("test")


def _write_image_folder(root: Path, split: str, per_class: int = 3) -> None:
    modes = ["RGB", "L", "RGBA", "P", "CMYK"]
    for c, name in enumerate(["cat", "dog"]):
        folder = root / split / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            mode = modes[(c * per_class + i) % len(modes)]
            size = (40 + 7 * i, 25 + 11 * c)  # odd sizes and aspect ratios
            image = Image.new("RGB", size, (200 * c, 40 * i, 90)).convert(mode)
            image.save(folder / f"{i}.{'jpg' if mode in ('L', 'CMYK') else 'png'}")


def test_image_folder_with_val_split(tmp_path) -> None:
    _write_image_folder(tmp_path, "train")
    _write_image_folder(tmp_path, "val", per_class=2)
    dm = ImageFolderDataModule(str(tmp_path), image_size=32, loader={"batch_size": 4})
    assert dm.class_names == ["cat", "dog"] and dm.num_classes == 2
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (6, 4)
    assert dm.test_set is dm.val_set
    images, labels = next(iter(dm.val_dataloader()))
    assert images.shape == (4, 3, 32, 32) and labels.tolist() == [0, 0, 1, 1]


def test_image_folder_holds_out_validation_when_there_is_no_val_folder(tmp_path) -> None:
    _write_image_folder(tmp_path, "train", per_class=5)
    dm = ImageFolderDataModule(str(tmp_path), image_size=16, in_chans=1, val_fraction=0.2, loader={"num_workers": 0})
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (8, 2)
    image, _ = dm.train_set[0]
    assert image.shape == (1, 16, 16)


def test_image_folder_without_train_split_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(DatasetNotFoundError, match="expected .*/train/<class>/<image>"):
        ImageFolderDataModule(str(tmp_path))
