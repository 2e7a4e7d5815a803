"""The classification DataModules: Fashion-MNIST, CIFAR-10 and any ImageFolder tree.

Datasets yield ``(uint8 image (C, H, W), label)``. Normalisation and the cheap augmentations (random
crop with padding, horizontal flip) run on whole batches after they reach the device, in
``on_after_batch_transfer``: one vectorised op per batch instead of Python per sample, on the GPU when
there is one. ``num_classes``, ``class_names``, ``in_chans``, ``image_size``, ``mean`` and ``std`` are
known right after construction, so LightningCLI links them into the model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from vision_attn.data import cifar10, fashion_mnist, scenes
from vision_attn.data.backgrounds import check_reuse, fill_canvases
from vision_attn.data.classification import (
    ImageFileDataset,
    PlacedItems,
    TensorImageDataset,
    collate_readable,
    random_erase,
    random_hflip,
    random_pad_crop,
    scan_split,
    split_train_val,
)
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.scene_items import SceneItemDataset, check_item_style
from vision_attn.data.scenes import SceneStyle
from vision_attn.datamodules.base import SplitDataModule
from vision_attn.datamodules.data_options import Augmentation, Canvas
from vision_attn.errors import DatasetNotFoundError
from vision_attn.option_groups import Loader

log = logging.getLogger(__name__)

# The DataModules' defaults where they differ from the groups' own
LOADER = Loader(batch_size=128)
HELD_OUT_LOADER = Loader(batch_size=128, eval_batch_size=1000)  # a whole split of small images in a few batches
CIFAR10_AUGMENTATION = Augmentation(pad_crop=4, hflip=True)
IMAGE_FOLDER_LOADER, IMAGE_FOLDER_AUGMENTATION = Loader(batch_size=64, num_workers=2), Augmentation(hflip=True)


class ClassificationDataModule(SplitDataModule):
    """Base for the image classification DataModules; subclasses fill the datasets and metadata. ``loader`` says
    how splits are batched, ``augmentation`` what training batches go through."""

    def __init__(self, *, loader: Loader = LOADER, augmentation: Augmentation = Augmentation()) -> None:
        super().__init__()
        self.loader = Loader.coerce(loader, LOADER)
        self.augmentation = Augmentation.coerce(augmentation)
        self.set_bad_image_policy(self.loader.on_bad_image)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.class_names: list[str] = []
        self.in_chans: int = 3
        self.image_size: int = 32
        self.mean: list[float] = [0.5] * 3
        self.std: list[float] = [0.5] * 3

    @property
    def num_classes(self) -> int:
        """How many classes the labels count, for the CLI to link into the model."""
        return len(self.class_names)

    def _loader(self, dataset: Dataset | None, *, train: bool) -> DataLoader:
        drop_last = train and dataset is not None and len(dataset) > self.loader.batch_size  # type: ignore[arg-type]
        return self._make_loader(dataset, train=train, collate_fn=collate_readable, drop_last=drop_last)

    def predict_dataloader(self) -> DataLoader:
        """The test split, in order, each batch ending with its images' places (``PlacedItems``) to name them."""
        return self._loader(None if self.test_set is None else PlacedItems(self.test_set, "test"), train=False)

    def on_after_batch_transfer(self, batch: tuple[Any, ...] | None, dataloader_idx: int) -> tuple[Any, ...] | None:
        """The batch as the model reads it (``prepare_batch``); a prediction batch keeps its places last."""
        if batch is not None and getattr(self.trainer, "predicting", False):
            *items, places = batch
            return (*self.prepare_batch(tuple(items), dataloader_idx), places)  # type: ignore[misc]
        return self.prepare_batch(batch, dataloader_idx)

    def prepare_batch(self, batch: tuple[Tensor, Tensor] | None,
                      dataloader_idx: int) -> tuple[Tensor, Tensor] | None:
        """(images, labels) on the device: training batches augmented, every batch normalised."""
        if batch is None:  # every image of the batch was unreadable and skipped
            return None
        self.count_train_batch()
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            images = self.augment(images)
        return self.normalize(images), labels

    def augment(self, images: Tensor, *, erase: bool = True) -> Tensor:
        """A training batch (B, C, H, W) uint8 with the configured random shifts, flips and erasing."""
        options = self.augmentation
        if options.pad_crop:
            images = random_pad_crop(images, options.pad_crop)
        if options.hflip:
            images = random_hflip(images)
        if erase and options.erase_prob:
            images = random_erase(images, options.erase_prob)
        return images


class HeldOutValidationDataModule(ClassificationDataModule):
    """A dataset with official train and test splits held in memory; validation is a fixed hold-out of train.

    Subclasses say how to read a split (``load_split``); the splitting and loaders are shared.

    Args:
        root: where to look for the dataset (after the system location), and where a download goes
        val_size: images of the official train split held out for validation
        split_seed: the seed of that hold-out
        download: fetch the dataset when it is nowhere to be found
    """

    def __init__(self, root: str, *, val_size: int = 5000, split_seed: int = 0, download: bool = True,
                 loader: Loader = HELD_OUT_LOADER, **options: Any) -> None:
        super().__init__(loader=Loader.coerce(loader, HELD_OUT_LOADER), **options)
        self.root = root
        self.val_size = val_size
        self.split_seed = split_seed
        self.download = download

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, C, H, W), labels (N,)) of the official ``train`` or ``test`` split."""
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        """The stage's splits in memory: train and its validation hold-out, or the official test split."""
        if stage in (None, "fit", "validate") and self.train_set is None:
            full = TensorImageDataset(*self.load_split("train"))
            self.train_set, self.val_set = split_train_val(full, self.val_size, self.split_seed)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = TensorImageDataset(*self.load_split("test"))


class FashionMNISTDataModule(HeldOutValidationDataModule):
    """Fashion-MNIST: a fixed hold-out of the training set for validation, the official test set for test.
    The options are those of ``HeldOutValidationDataModule`` and ``ClassificationDataModule``.

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
    """

    def __init__(self, root: str = "data/fashion_mnist", **options: Any) -> None:
        super().__init__(root, **options)
        self.class_names = list(fashion_mnist.CLASS_NAMES)
        self.in_chans = 1
        self.image_size = 28
        self.mean, self.std = [fashion_mnist.MEAN], [fashion_mnist.STD]

    def prepare_data(self) -> None:
        """Find Fashion-MNIST, downloading it when it is nowhere to be found and ``download`` allows."""
        fashion_mnist.find_fashion_mnist(self.root, download=self.download)

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, 1, 28, 28), labels (N,)) of the official ``train`` or ``test`` split."""
        images, labels = fashion_mnist.load_fashion_mnist(fashion_mnist.find_fashion_mnist(self.root, download=False),
                                                          split)
        return images.unsqueeze(1), labels  # (N, 28, 28) -> (N, 1, 28, 28)


class FashionMNISTCanvasDataModule(FashionMNISTDataModule):
    """Fashion-MNIST items pasted at a random place on a black square (``canvas.size``), labelled by their class:
    a classifier that must find the item before it can name it, so that its attention can be checked against
    the item's mask (the item's pixels > 0).

    Training items get a new place in every batch (drawn on the device, after the batch arrives; shifts and flips
    act on the item before it is placed), and training batches are ``(images, labels, boxes)`` with each item's
    place, (B, 4) [x, y, w, h] in pixels, for ``ViTTask``'s ``training.attention_grounding``. With
    ``canvas.train_window`` a training image is only that square of its canvas around the item, at a random place
    whose corner is a multiple of ``canvas.window_step`` (set it to the ViT's patch size), and the batch says where:
    ``(images, labels, boxes, origins)``, origins (B, 2) [x, y] on the canvas, boxes in the window. The ViT then
    embeds only the window's patches, each with the position embedding of its place on the canvas: a 40-pixel
    window of a 56-pixel canvas costs about half a step, the rest of the canvas being black.
    ``canvas.background_noise`` fills every pixel of a training canvas but its item's with uniform grey noise up to
    a level drawn per image from 0 to it, so that the model learns the item, not "whatever is not black";
    ``canvas.background`` draws one of the scenes' backgrounds there instead (``data.backgrounds``: noise, textures,
    distractors or mixed). Evaluation canvases stay black. Validation and test items get a fixed place from
    ``canvas.seed``, and their batches are ``(images, labels, masks)``, masks (B, S, S) bool (the item's pixels >
    0), so the ViT logs rollout mass and the pointing game as it validates and tests. Normalised by the canvases'
    own mean and std. The other options are those of ``FashionMNISTDataModule``.

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
    """

    def __init__(self, root: str = "data/fashion_mnist", *, canvas: Canvas = Canvas(), **options: Any) -> None:
        super().__init__(root, **options)
        self.canvas = Canvas.coerce(canvas)
        self.canvas_size, self.train_window, self.window_step = (self.canvas.size, self.canvas.train_window,
                                                                 self.canvas.window_step)
        self.background_noise, self.seed = self.canvas.background_noise, self.canvas.seed
        self.background = self.canvas.background_spec()
        self.image_size = self.canvas.size
        mean, std = fashion_mnist.canvas_mean_std(self.canvas.size)
        self.mean, self.std = [mean], [std]

    def _placed(self, dataset: Dataset, seed: int) -> TensorImageDataset:
        """A split's items at fixed places drawn from ``seed``, as one in-memory tensor of canvases."""
        items, labels = (torch.stack(column) for column in zip(*(dataset[i] for i in range(len(dataset))),
                                                               strict=True))
        places = fashion_mnist.random_places(len(items), self.canvas_size,
                                             generator=torch.Generator().manual_seed(seed))
        return TensorImageDataset(fashion_mnist.place_on_canvas(items, places, self.canvas_size), labels)

    def setup(self, stage: str | None = None) -> None:
        """The Fashion-MNIST splits, with the validation and test items placed once on their canvases."""
        fresh_val, fresh_test = self.val_set is None, self.test_set is None
        super().setup(stage)
        if fresh_val and self.val_set is not None:
            self.val_set = self._placed(self.val_set, self.seed)
        if fresh_test and self.test_set is not None:
            self.test_set = self._placed(self.test_set, self.seed + 1)

    def prepare_batch(self, batch: tuple[Tensor, Tensor] | None, dataloader_idx: int) -> tuple[Tensor, ...] | None:
        """Training items placed on fresh canvases, (images, labels, boxes[, origins]); evaluation batches with
        the items' masks, (images, labels, masks); normalised."""
        if batch is None:
            return None
        images, labels = batch
        if self.trainer is not None and self.trainer.training:
            # the item is shifted and mirrored, then placed (as mirroring the canvas would), then erased
            self.count_train_batch()
            items = self.augment(images, erase=False)
            size = self.train_window or self.canvas_size
            places = fashion_mnist.random_places(len(images), size, device=images.device)
            canvases = fashion_mnist.place_on_canvas(items, places, size)
            canvases = fill_canvases(canvases, items, noise=self.background_noise, background=self.background)
            if self.augmentation.erase_prob:
                canvases = random_erase(canvases, self.augmentation.erase_prob)
            boxes = torch.cat([places, places.new_full(places.shape, fashion_mnist.ITEM_SIZE)], dim=1)
            if self.train_window is None:
                return self.normalize(canvases), labels, boxes
            # a window of the canvas around the item: where it lies, in whole steps (the ViT's patches)
            steps = (self.canvas_size - self.train_window) // self.window_step + 1
            origins = torch.randint(0, steps, (len(images), 2), device=images.device) * self.window_step
            return self.normalize(canvases), labels, boxes, origins
        masks = images[:, 0] > 0
        normalised, labels = super().prepare_batch((images, labels), dataloader_idx)  # type: ignore[misc]
        return normalised, labels, masks


class FashionSceneItemsDataModule(FashionMNISTDataModule):
    """Fashion-MNIST items drawn one at a time as the Fashion scenes draw them (``data.scene_items``): RGB
    ``canvas_size`` squares with one tinted item at a random place, labelled by its class. The set the scene
    captioner's encoder is pretrained on (``configs/captioner/fashion_scene_items.yaml``).

    ``style`` is a scene style (``{"shade_jitter": 1.0, "scale_jitter": 0.1}``; its layout does not apply).
    Training items get a new colour, shade, size and place each epoch; validation and test items are drawn
    the same way every time (from ``seed``). Normalised with ImageNet's mean and std, as the captioner's
    images are. The other options are those of ``FashionMNISTDataModule``.

    Args:
        root: where to look for Fashion-MNIST after Debian's dataset-fashion-mnist, and where a download goes
        style: how the items are drawn, a scene style ({hue_jitter: 1.0, scale_jitter: 0.1}; null: exact tints)
        canvas_size: the side of an item's square, in pixels (a scene's cell)
        seed: the seed of the validation and test items' colours, sizes and places
        background_reuse: training items draw one new background (of the style's clutter) per this many items and
            reuse the others, turned and mirrored (1: every item its own; a background costs ~0.2 ms of Python)
    """

    def __init__(self, root: str = "data/fashion_mnist", *, style: dict | None = None, canvas_size: int = 32,
                 seed: int = 0, background_reuse: int = 1, **options: Any) -> None:
        super().__init__(root, **options)
        self.style = SceneStyle.of(style)
        if self.style.layout != "grid":
            log.warning("scene items: the style's layout (%s) does not apply to single items", self.style.layout)
        check_item_style(self.style, canvas_size)
        self.canvas_size = canvas_size
        self.seed = seed
        check_reuse(background_reuse)  # here, before any data is read
        self.background_reuse = background_reuse
        self.class_names = list(scenes.CLASS_WORDS)
        self.in_chans = 3
        self.image_size = canvas_size
        self.mean, self.std = list(IMAGENET_MEAN), list(IMAGENET_STD)

    @property
    def colour_names(self) -> list[str]:
        """The items' colours, in the order of the colour labels, for the CLI to link into the model."""
        return list(scenes.COLOURS)

    def setup(self, stage: str | None = None) -> None:
        """The Fashion-MNIST splits, with their items drawn as scene items (fixed ones for validation and test)."""
        super().setup(stage)
        draw = {"style": self.style, "canvas_size": self.canvas_size}
        if self.train_set is not None and not isinstance(self.train_set, SceneItemDataset):
            self.train_set = SceneItemDataset(self.train_set, background_reuse=self.background_reuse, **draw)
            self.val_set = SceneItemDataset(self.val_set, seed=self.seed, **draw)  # type: ignore[arg-type]
        if self.test_set is not None and not isinstance(self.test_set, SceneItemDataset):
            self.test_set = SceneItemDataset(self.test_set, seed=self.seed + 1, **draw)


class CIFAR10DataModule(HeldOutValidationDataModule):
    """CIFAR-10: a fixed hold-out of the training set for validation, the official test set for test, with
    random shifts and flips by default. The other options are those of ``HeldOutValidationDataModule``.

    Args:
        root: where CIFAR-10 is (either release), or where a download goes
    """

    def __init__(self, root: str = "data/cifar10", *, augmentation: Augmentation = CIFAR10_AUGMENTATION,
                 **options: Any) -> None:
        super().__init__(root, augmentation=Augmentation.coerce(augmentation, CIFAR10_AUGMENTATION), **options)
        self.class_names = list(cifar10.CLASS_NAMES)
        self.in_chans = 3
        self.image_size = 32
        self.mean, self.std = list(cifar10.MEAN), list(cifar10.STD)

    def prepare_data(self) -> None:
        """Find CIFAR-10 under ``root``, downloading it there when missing and ``download`` allows."""
        cifar10.load_cifar10(self.root, "test", download=self.download)

    def load_split(self, split: str) -> tuple[Tensor, Tensor]:
        """(uint8 images (N, 3, 32, 32), labels (N,)) of the official ``train`` or ``test`` split."""
        return cifar10.load_cifar10(self.root, split)


class ImageFolderDataModule(ClassificationDataModule):
    """``root/train/<class>/*`` (required), ``root/val/...`` (else a hold-out of train), ``root/test/...``.

    Class names are the train split's folder names, sorted; the test split falls back to val.
    ``loader.on_bad_image: skip`` leaves unreadable images out, each named in a warning and counted per epoch.

    Args:
        root: the folder holding train/ (and val/, test/), one subfolder per class
        image_size: images are resized to squares of this many pixels
        in_chans: 3 (RGB) or 1 (grey)
        val_fraction: without a val/ folder, this share of train/ is held out for validation
        split_seed: the seed of that hold-out
        random_resized_crop: training images are random resized crops (else resized whole, as in evaluation)
        mean: per-channel mean the images are normalised with (null: ImageNet's for RGB, 0.5 for grey)
        std: per-channel standard deviation (null: ImageNet's for RGB, 0.5 for grey)
    """

    def __init__(
        self,
        root: str,
        *,
        image_size: int = 224,
        in_chans: int = 3,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        random_resized_crop: bool = True,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        loader: Loader = IMAGE_FOLDER_LOADER,
        augmentation: Augmentation = IMAGE_FOLDER_AUGMENTATION,
    ) -> None:
        super().__init__(loader=Loader.coerce(loader, IMAGE_FOLDER_LOADER),
                         augmentation=Augmentation.coerce(augmentation, IMAGE_FOLDER_AUGMENTATION))
        if in_chans not in (1, 3):
            raise ValueError(f"in_chans must be 1 or 3, got {in_chans}")
        self.root = Path(root)
        train_dir = self.root / "train"
        if not train_dir.is_dir():
            raise DatasetNotFoundError(f"{train_dir}: missing; expected {self.root}/train/<class>/<image> folders")
        self.class_names = sorted(d.name for d in train_dir.iterdir() if d.is_dir())
        if not self.class_names:
            raise DatasetNotFoundError(f"{train_dir}: no class folders")
        self.image_size = image_size
        self.in_chans = in_chans
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.random_resized_crop = random_resized_crop
        default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if in_chans == 3 else ([0.5], [0.5])
        self.mean, self.std = mean or default_mean, std or default_std
        if len(self.mean) != in_chans or len(self.std) != in_chans:
            raise ValueError(f"mean and std need {in_chans} values each, got {self.mean} and {self.std}")

    def _dataset(self, samples: list[tuple[Path, int]], *, train: bool) -> ImageFileDataset:
        return ImageFileDataset(
            samples, image_size=self.image_size, in_chans=self.in_chans, train=train and self.random_resized_crop,
            **self.bad_image_options,
        )

    def setup(self, stage: str | None = None) -> None:
        """The image files of every split: val/ or a hold-out of train/, test/ or else the validation set."""
        train_samples = scan_split(self.root / "train", self.class_names)
        val_dir, test_dir = self.root / "val", self.root / "test"
        if val_dir.is_dir():
            self.train_set = self._dataset(train_samples, train=True)
            self.val_set = self._dataset(scan_split(val_dir, self.class_names), train=False)
        else:
            val_size = max(1, round(self.val_fraction * len(train_samples)))
            train_part, val_part = split_train_val(train_samples, val_size, self.split_seed)  # type: ignore[arg-type]
            self.train_set = self._dataset(list(train_part), train=True)
            self.val_set = self._dataset(list(val_part), train=False)
            log.info("no %s: holding out %d of %d train images for validation", val_dir, val_size,
                     len(train_samples))
        if test_dir.is_dir():
            self.test_set = self._dataset(scan_split(test_dir, self.class_names), train=False)
        else:
            self.test_set = self.val_set
