"""Fashion-MNIST items drawn one at a time as the Fashion scenes draw them, for the encoder's pretraining."""

from __future__ import annotations

import logging
from typing import Any

from torch.utils.data import Dataset

from vision_attn.data import scenes
from vision_attn.data.backgrounds import check_reuse
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.scene_items import SceneItemDataset, check_item_style
from vision_attn.data.scenes import SceneStyle
from vision_attn.datamodules.fashion_mnist_datamodule import FashionMNISTDataModule

log = logging.getLogger(__name__)


class FashionSceneItemsDataModule(FashionMNISTDataModule):
    """Fashion-MNIST items drawn one at a time as the Fashion scenes draw them (``data.scene_items``): RGB
    ``canvas_size`` squares with one tinted item at a random place, labelled by its class. The set the scene
    captioner's encoder is pretrained on (``configs/captioner/fashion_scene_items.yaml``).

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
        style: how the items are drawn, a scene style ({hue_jitter: 1.0, scale_jitter: 0.1}; null: exact tints)
        canvas_size: the side of an item's square, in pixels (a scene's cell)
        seed: the seed of the validation and test items' colours, sizes and places
        background_reuse: training items draw one new background (of the style's clutter) per this many items and
            reuse the others, turned and mirrored (1: every item its own; drawing one is Python work per item)
    """

    def __init__(self, root: str = "data/fashion_mnist", *, style: dict | None = None, canvas_size: int = 32,
                 seed: int = 0, background_reuse: int = 1, **options: Any) -> None:
        super().__init__(root, **options)
        self.style = SceneStyle.of(style)
        if self.style.layout != "grid":
            log.warning("scene items: the style's layout (%s) does not apply to single items", self.style.layout)
        check_item_style(self.style, canvas_size)
        check_reuse(background_reuse)  # here, before any data is read
        self.canvas_size, self.seed, self.background_reuse = canvas_size, seed, background_reuse
        self.class_names, self.in_chans, self.image_size = list(scenes.CLASS_WORDS), 3, canvas_size
        self.mean, self.std = list(IMAGENET_MEAN), list(IMAGENET_STD)

    @property
    def colour_names(self) -> list[str]:
        """The items' colours, in the order of the colour labels, for the CLI to link into the model."""
        return list(scenes.COLOURS)

    def served(self, dataset: Dataset, role: str) -> SceneItemDataset:
        """The split's items drawn as scene items: afresh in every batch for training, fixed ones drawn from ``seed``
        for validation (test: ``seed + 1``)."""
        draw = {"style": self.style, "canvas_size": self.canvas_size}
        if role == "train":
            return SceneItemDataset(dataset, background_reuse=self.background_reuse, **draw)
        return SceneItemDataset(dataset, seed=self.seed + (role == "test"), **draw)
