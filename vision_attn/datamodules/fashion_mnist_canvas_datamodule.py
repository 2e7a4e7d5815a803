"""Fashion-MNIST items on a larger black canvas, each at a random place: the data of a classifier whose attention
is checked against the item's mask."""

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

    Training items get a new place in every batch (drawn on the device; shifts and flips act on the item before it
    is placed), and training batches are ``(images, labels, boxes)``, boxes (B, 4) [x, y, w, h] in pixels for
    ``ViTTask``'s ``training.attention_grounding``. With ``canvas.train_window`` a training image is only that
    square of its canvas around the item, its corner a multiple of ``canvas.window_step``, and the batch says where:
    ``(images, labels, boxes, origins)``, origins (B, 2) [x, y] on the canvas, boxes in the window; the ViT embeds
    only the window's patches, each with the position embedding of its place on the canvas. ``canvas.background``
    and ``canvas.background_noise`` fill every pixel of a training canvas but its item's, so that the model learns
    the item, not "whatever is not black"; evaluation canvases stay black. Validation and test items get a fixed
    place from ``canvas.seed``, and their batches are ``(images, labels, masks)``, masks (B, S, S) bool (the item's
    pixels > 0), for the rollout mass and the pointing game. Normalised by the canvases' own mean and std.

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

    def _placed(self, dataset: Dataset, seed: int) -> TensorImageDataset:
        """A split's items at fixed places drawn from ``seed``, as one in-memory tensor of canvases."""
        items, labels = (torch.stack(column) for column in zip(*(dataset[i] for i in range(len(dataset))),
                                                               strict=True))
        generator = torch.Generator().manual_seed(seed)
        places = fashion_mnist.random_places(len(items), self.canvas.size, generator=generator)
        return TensorImageDataset(fashion_mnist.place_on_canvas(items, places, self.canvas.size), labels)

    def setup(self, stage: str | None = None) -> None:
        """The Fashion-MNIST splits, with the validation and test items placed once on their canvases."""
        fresh_val, fresh_test = self.val_set is None, self.test_set is None
        super().setup(stage)
        if fresh_val and self.val_set is not None:
            self.val_set = self._placed(self.val_set, self.canvas.seed)
        if fresh_test and self.test_set is not None:
            self.test_set = self._placed(self.test_set, self.canvas.seed + 1)

    def prepare_batch(self, batch: tuple[Tensor, Tensor] | None, dataloader_idx: int) -> tuple[Tensor, ...] | None:
        """Training items placed on fresh canvases, (images, labels, boxes[, origins]); evaluation batches with
        the items' masks, (images, labels, masks); normalised."""
        if batch is None:
            return None
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            # the item is shifted and mirrored, then placed (as mirroring the canvas would), then erased
            self.count_train_batch()
            items, canvas = self.augment(images, erase=False), self.canvas
            size = canvas.train_window or canvas.size
            places = fashion_mnist.random_places(len(images), size, device=images.device)
            canvases = fashion_mnist.place_on_canvas(items, places, size)
            canvases = fill_canvases(canvases, items, noise=canvas.background_noise, background=self.background)
            if self.augmentation.erase_prob:
                canvases = random_erase(canvases, self.augmentation.erase_prob)
            boxes = torch.cat([places, places.new_full(places.shape, fashion_mnist.ITEM_SIZE)], dim=1)
            if canvas.train_window is None:
                return self.normalize(canvases), labels, boxes
            # a window of the canvas around the item: where it lies, in whole steps (the ViT's patches)
            steps = (canvas.size - canvas.train_window) // canvas.window_step + 1
            origins = torch.randint(0, steps, (len(images), 2), device=images.device) * canvas.window_step
            return self.normalize(canvases), labels, boxes, origins
        masks = images[:, 0] > 0
        normalised, labels = super().prepare_batch((images, labels), dataloader_idx)  # type: ignore[misc]
        return normalised, labels, masks
