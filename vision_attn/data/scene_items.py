"""Fashion-MNIST items drawn one at a time as the Fashion scenes draw them (``draw_item``): the classification set
the scene captioner's encoder is pretrained on, as the paper's VGG was on ImageNet. Each item is tinted, resized
and placed at random on a ``canvas_size`` square over the style's background; its targets are its class and its
colour, as Anderson et al. (2018) pretrain on object classes and attributes.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset, Subset

from vision_attn.data.backgrounds import BackgroundPool, fill_canvases
from vision_attn.data.classification_datasets import TensorImageDataset
from vision_attn.data.scenes import COLOURS, ITEM_SIZE, SceneStyle, draw_item


def check_item_style(style: SceneStyle, canvas_size: int) -> None:
    """Refuse, in one line, a style out of range or a canvas too small for the largest item it draws."""
    style.check(canvas_size=2**20, grid_size=1)  # the value ranges only: one item needs no grid or free room
    largest = style.item_sizes()[1]
    if canvas_size < largest:
        raise ValueError(f"canvas_size {canvas_size} is smaller than the largest item ({largest} px at "
                         f"scale_jitter {style.scale_jitter})")


def gather(source: Dataset, indices: list[int]) -> tuple[Tensor, Tensor]:
    """Items ``indices`` of ``source`` as one batch (images, labels (B,)): one indexing of a ``TensorImageDataset``."""
    held, positions = source, indices
    if isinstance(held, Subset):
        held, positions = held.dataset, [held.indices[index] for index in indices]
    if isinstance(held, TensorImageDataset):
        rows = torch.as_tensor(positions, dtype=torch.long)
        return held.images[rows], held.labels[rows]
    images, labels = zip(*(source[index] for index in indices), strict=True)
    return torch.stack(images), torch.as_tensor(labels, dtype=torch.long)


def paste(canvases: Tensor, rows: np.ndarray, corners: np.ndarray, items: Tensor) -> None:
    """Write ``items`` (n, C, s, s) into ``canvases`` (B, C, S, S) in place, item k into canvas ``rows[k]`` at
    ``corners[k]`` (top, left): one write at flat positions ((row · C + channel) · S + top + i) · S + left + j."""
    _, channels, square, _ = canvases.shape
    size = items.shape[-1]
    starts = torch.from_numpy(((rows * channels) * square + corners[:, 0]) * square + corners[:, 1])  # (n,)
    steps = torch.arange(size)
    offsets = (torch.arange(channels).view(-1, 1, 1) * square + steps.view(1, -1, 1)) * square + steps  # (C, s, s)
    canvases.view(-1).put_(starts.view(-1, 1, 1, 1) + offsets, items)


def divide_by_255(products: Tensor) -> Tensor:
    """⌊n / 255⌋ of int32 products of two bytes (0 ≤ n ≤ 255²), exactly, by shifts: (n + (n >> 8) + 1) >> 8."""
    return (products + (products >> 8) + 1) >> 8


class SceneItemDataset(Dataset):
    """Grey items of ``source`` (``(uint8 (1, 28, 28), label)``) drawn as scenes draw them: ``(uint8 (3, S, S),
    [label, colour])``, colour indexing ``COLOURS``. ``seed=None`` draws each item afresh at every read (training;
    from torch's RNG, per loader process); an int draws item ``i`` once from ``(seed, i)``. ``background_reuse``
    > 1 takes backgrounds from a ``BackgroundPool``."""

    def __init__(self, source: Dataset, *, style: SceneStyle | None = None, canvas_size: int = 32,
                 seed: int | None = None, background_reuse: int = 1) -> None:
        self.source = source
        self.style = style or SceneStyle()
        check_item_style(self.style, canvas_size)
        self.smallest, self.largest = self.style.item_sizes()
        self.canvas_size = canvas_size
        self.background = self.style.background_spec()
        self.seed = seed
        self.pool = BackgroundPool(self.background, reuse=background_reuse) if background_reuse != 1 else None
        self.colours = list(COLOURS)
        self._stream: tuple[int, np.random.Generator] | None = None  # (process id, training draws)
        self._drawn: dict[int, tuple[Tensor, Tensor]] = {}  # seeded items already drawn, by index

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def _rng(self, index: int) -> np.random.Generator:
        if self.seed is not None:
            return np.random.default_rng([self.seed, index])
        if self._stream is None or self._stream[0] != os.getpid():  # one stream per DataLoader worker process
            self._stream = (os.getpid(), np.random.default_rng(int(torch.randint(0, 2**62, ()).item())))
        return self._stream[1]

    def __getitems__(self, indices: list[int]) -> list[tuple[Tensor, Tensor]]:
        """The items ``indices``; training items are drawn as one batch, with torch's antialiased bilinear resize."""
        if self.seed is not None:  # validation and test: item i is always drawn from (seed, i)
            return [self[index] for index in indices]
        rng = self._rng(0)
        greys, labels = gather(self.source, indices)
        greys = greys.reshape(-1, 1, ITEM_SIZE, ITEM_SIZE)  # (B, 1, 28, 28) uint8
        count = len(greys)
        sizes = rng.integers(self.smallest, self.largest + 1, size=count) if self.style.scaled \
            else np.full(count, ITEM_SIZE)
        colours = rng.integers(len(self.colours), size=count)
        tints = torch.from_numpy(self.style.tints(rng, [self.colours[c] for c in colours]).astype(np.int32))
        corners = rng.integers(0, self.canvas_size - sizes[:, None] + 1, size=(count, 2))  # (top, left) each
        canvases = torch.zeros(count, 3, self.canvas_size, self.canvas_size, dtype=torch.uint8)
        for size in np.unique(sizes):
            rows = np.flatnonzero(sizes == size)
            items = greys[rows]
            if size != ITEM_SIZE:  # bilinear, antialiased when shrinking, as PIL's resize
                items = F.interpolate(items.float(), size=(int(size), int(size)), mode="bilinear",
                                      align_corners=False, antialias=True).round().clamp(0, 255).to(torch.uint8)
            tinted = divide_by_255(items.to(torch.int32) * tints[rows].view(-1, 3, 1, 1)).to(torch.uint8)  # n,3,s,s
            paste(canvases, rows, corners[rows], tinted)
        canvases = fill_canvases(canvases, greys, noise=0, background=self.background, pool=self.pool)
        targets = torch.stack([labels, torch.from_numpy(colours)], dim=1)
        return list(zip(canvases, targets, strict=True))

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if self.seed is not None:
            if index not in self._drawn:
                self._drawn[index] = self._draw(index)
            return self._drawn[index]
        return self._draw(index)

    def _draw(self, index: int) -> tuple[Tensor, Tensor]:
        image, label = self.source[index]
        rng = self._rng(index)
        size = int(rng.integers(self.smallest, self.largest + 1)) if self.style.scaled else ITEM_SIZE
        colour = int(rng.integers(len(self.colours)))
        tint = self.style.tint(rng, self.colours[colour])
        item = draw_item(image.reshape(ITEM_SIZE, ITEM_SIZE).numpy(), tint, size)
        top, left = (int(v) for v in rng.integers(0, self.canvas_size - size + 1, size=2))
        grey = image.reshape(1, ITEM_SIZE, ITEM_SIZE).numpy()  # after the item's draws (black draws nothing)
        canvas = self.background.draw(rng, self.canvas_size, fragments=grey)[0]
        square = canvas[top : top + size, left : left + size]
        opaque = item.any(axis=2)
        square[opaque] = item[opaque]
        return torch.from_numpy(canvas).permute(2, 0, 1), torch.tensor([int(label), colour])  # stacked by collate
