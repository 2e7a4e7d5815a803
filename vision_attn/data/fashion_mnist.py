"""Fashion-MNIST (Xiao et al. 2017): 70k 28×28 grey images of 10 garment classes, read from Debian's
``dataset-fashion-mnist`` location, the configured root, or torchvision's download."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.errors import DatasetNotFoundError
from vision_attn.io import OwnedFolder

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
CLASS_NAMES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
MEAN, STD = 0.2860, 0.3530  # over the 60k training images
ITEM_SIZE = 28


def canvas_mean_std(canvas_size: int) -> tuple[float, float]:
    """The pixel mean and std of 28×28 items on black ``canvas_size`` squares, from the items' own (MEAN, STD)."""
    share = (ITEM_SIZE / canvas_size) ** 2
    mean = MEAN * share
    return mean, ((STD**2 + MEAN**2) * share - mean**2) ** 0.5


def random_places(count: int, canvas_size: int, *, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> Tensor:
    """(count, 2) uniform (left, top) corners that keep a 28×28 item inside a ``canvas_size`` square."""
    return torch.randint(0, canvas_size - ITEM_SIZE + 1, (count, 2), generator=generator, device=device)


def place_on_canvas(items: Tensor, places: Tensor, canvas_size: int) -> Tensor:
    """Items (N, C, 28, 28) pasted with their (left, top) corner at ``places`` (N, 2) on black (N, C, S, S)."""
    count, channels, height, width = items.shape
    canvases = items.new_zeros(count, channels, canvas_size, canvas_size)
    rows = (places[:, 1, None] + torch.arange(height, device=items.device))[:, :, None]  # (N, h, 1)
    cols = (places[:, 0, None] + torch.arange(width, device=items.device))[:, None, :]  # (N, 1, w)
    canvases[torch.arange(count, device=items.device)[:, None, None], :, rows, cols] = items.permute(0, 2, 3, 1)
    return canvases


def scaled_side(factor: float) -> int:
    """An item's side in pixels at ``factor`` times its 28."""
    return round(ITEM_SIZE * factor)


def place_scaled_on_canvas(items: Tensor, scale: tuple[float, float], canvas_size: int) -> tuple[Tensor, Tensor]:
    """Items (N, C, 28, 28) uint8, each resized (bilinear, antialiased) to a side drawn uniformly from ``scale``
    times 28 pixels and pasted at a uniform place inside a black ``canvas_size`` square: (canvases (N, C, S, S),
    boxes (N, 4) [x, y, w, h])."""
    count = len(items)
    factors = torch.empty(count, device=items.device).uniform_(*scale)
    sides = torch.round(factors * ITEM_SIZE).long()
    corners = (torch.rand(count, 2, device=items.device) * (canvas_size - sides + 1)[:, None]).long()
    canvases = items.new_zeros(count, items.shape[1], canvas_size, canvas_size)
    for side in sides.unique().tolist():
        chosen = sides == side
        resized = F.interpolate(items[chosen].float(), size=(side, side), mode="bilinear", antialias=True,
                                align_corners=False)
        canvases[chosen] = place_on_canvas(resized.round().clamp(0, 255).to(items.dtype), corners[chosen],
                                           canvas_size)
    return canvases, torch.cat([corners, sides[:, None], sides[:, None]], dim=1)


def read_idx(path: Path) -> Tensor:
    """Read an IDX file (gzipped or not) into a uint8 tensor of the shape its header gives."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as file:
            data = file.read()
    except (OSError, EOFError) as error:
        raise ValueError(f"{path}: unreadable IDX file ({error})") from None
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] != 0x08:
        raise ValueError(f"{path}: not a uint8 IDX file (bad magic number)")
    ndim = data[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = math.prod(dims)
    if len(data) - header != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but holds {len(data) - header} bytes")
    return torch.frombuffer(bytearray(data[header:]), dtype=torch.uint8).reshape(dims)


def _has_files(directory: Path) -> bool:
    return all((directory / name).is_file() for pair in FILES.values() for name in pair)


def find_fashion_mnist(root: str | Path, *, download: bool = True) -> Path:
    """The folder holding the four Fashion-MNIST files: system location, then ``root``, then a download."""
    root = Path(root)
    candidates = [SYSTEM_DIR, root, root / "FashionMNIST" / "raw"]
    for directory in candidates:
        if _has_files(directory):
            return directory
    download_error = "download disabled"
    if download:
        try:
            from torchvision.datasets import FashionMNIST
            FashionMNIST(str(root), train=True, download=True)
            FashionMNIST(str(root), train=False, download=True)
            if _has_files(candidates[2]):
                return candidates[2]
            download_error = "download finished without the files"
        except Exception as error:  # noqa: BLE001 - any network failure means "not there"
            download_error = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise DatasetNotFoundError(f"Fashion-MNIST not found: looked in {SYSTEM_DIR} (apt-get install "
                               f"dataset-fashion-mnist), in {root} (the configured root), and torchvision's download "
                               f"failed ({download_error})")


def load_fashion_mnist(directory: Path, split: str) -> tuple[Tensor, Tensor]:
    """(images uint8 (N, 28, 28), labels int64 (N,)) of the official ``train`` or ``test`` split."""
    image_file, label_file = FILES[split]
    images, labels = read_idx(directory / image_file), read_idx(directory / label_file)
    if images.ndim != 3 or len(images) != len(labels):
        raise ValueError(f"{directory}: {split} images {tuple(images.shape)} do not match labels {len(labels)}")
    return images, labels.long()


def export_samples(root: str | Path, out: str | Path, *, count: int, split: str = "test", seed: int = 0,
                   canvas_size: int = 28, overwrite: bool = False) -> list[Path]:
    """Write ``count`` random images of a split as ``<index>_<true class>.png`` into ``out`` (an ``io.OwnedFolder``);
    above 28, ``canvas_size`` pastes each at a random place on black, named ``..._at<left>-<top>.png``."""
    from PIL import Image
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if canvas_size < 28:
        raise ValueError(f"canvas size must be at least 28 (the garment's size), got {canvas_size}")
    owner = OwnedFolder(out, "export-samples", overwrite=overwrite)
    images, labels = load_fashion_mnist(find_fashion_mnist(root), split)
    if count > len(images):
        raise ValueError(f"count {count} is more than the {len(images)} images of Fashion-MNIST's {split} split")
    chosen = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    written = []
    places = random_places(count, canvas_size, generator=torch.Generator().manual_seed(seed + 1))
    with owner.staged() as staging:
        for index, (left, top) in zip(chosen, places.tolist(), strict=True):
            name = CLASS_NAMES[int(labels[index])].replace("/", "-").replace(" ", "-")
            garment = Image.fromarray(images[index].numpy(), mode="L")
            if canvas_size == 28:
                file_name, image = f"{index:05d}_{name}.png", garment
            else:
                file_name, image = f"{index:05d}_{name}_at{left}-{top}.png", Image.new("L", (canvas_size,) * 2)
                image.paste(garment, (left, top))
            image.save(staging / file_name)
            written.append(owner.path / file_name)
    return written
