"""Fashion-MNIST items at random places on a larger canvas: a classifier's attention checked against the item."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vision_attn.data import fashion_mnist
from vision_attn.data.backgrounds import fill_canvases
from vision_attn.data.classification_datasets import TensorImageDataset, random_erase
from vision_attn.datamodules.data_options import Canvas
from vision_attn.datamodules.fashion_mnist_datamodule import FashionMNISTDataModule


class FashionMNISTCanvasDataModule(FashionMNISTDataModule):
    """Fashion-MNIST items pasted at a random place on a black square (``canvas.size``), labelled by their class:
    a classifier that must find the item before it can name it, so that its attention can be checked against
    the item's mask (the item's pixels > 0).

    Training items get a new place in every batch (and with ``canvas.scale`` a new size); training batches are
    ``(images, labels, boxes)``, boxes (B, 4) [x, y, w, h] pixels, and with ``canvas.train_window`` ``(images,
    labels, boxes, origins)``: a window round the item, origins (B, 2) [x, y] on the canvas. Evaluation items get
    fixed places from ``canvas.seed``, on black, in batches ``(images, labels, masks)``, masks (B, S, S) the item's
    pixels > 0.

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
    """

    def __init__(self, root: str = "data/fashion_mnist", *, canvas: Canvas = Canvas(), **options: Any) -> None:
        super().__init__(root, **options)
        self.canvas = Canvas.coerce(canvas)
        self.background = self.canvas.background_spec()
        self.image_size = self.canvas.size
        mean, std = fashion_mnist.canvas_mean_std(self.canvas.size)
        self.mean, self.std = [mean], [std]

    def served(self, dataset: Dataset, role: str) -> Dataset:
        """Training items as they are (placed afresh in each batch); validation and test items placed once on their
        canvases, at places drawn from ``canvas.seed`` (test: ``canvas.seed + 1``), as one in-memory tensor."""
        if role == "train":
            return dataset
        items, labels = (torch.stack(column) for column in zip(*(dataset[i] for i in range(len(dataset))),
                                                               strict=True))
        generator = torch.Generator().manual_seed(self.canvas.seed + (role == "test"))
        places = fashion_mnist.random_places(len(items), self.canvas.size, generator=generator)
        return TensorImageDataset(fashion_mnist.place_on_canvas(items, places, self.canvas.size), labels)

    def prepare_batch(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, ...]:
        """Training items on fresh canvases, (images, labels, boxes[, origins]); evaluation ones with masks."""
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            # the item is shifted and mirrored, then placed (as mirroring the canvas would), then erased
            items, canvas = self.augment(images, erase=False), self.canvas
            size = canvas.train_window or canvas.size
            if canvas.scale is None:
                places = fashion_mnist.random_places(len(images), size, device=images.device)
                canvases = fashion_mnist.place_on_canvas(items, places, size)
                boxes = torch.cat([places, places.new_full(places.shape, fashion_mnist.ITEM_SIZE)], dim=1)
            else:  # each item at a size of its own
                canvases, boxes = fashion_mnist.place_scaled_on_canvas(items, tuple(canvas.scale), size)
            canvases = fill_canvases(canvases, items, noise=canvas.background_noise, background=self.background)
            if self.augmentation.erase_prob:
                canvases = random_erase(canvases, self.augmentation.erase_prob)
            if canvas.train_window is None:
                return self.normalize(canvases), labels, boxes
            # a window of the canvas around the item: where it lies, in whole steps (the ViT's patches)
            steps = (canvas.size - canvas.train_window) // canvas.window_step + 1
            origins = torch.randint(0, steps, (len(images), 2), device=images.device) * canvas.window_step
            return self.normalize(canvases), labels, boxes, origins
        masks = images[:, 0] > 0
        normalised, labels = super().prepare_batch((images, labels))
        return normalised, labels, masks
