"""The DataModules' option groups: captions' layout, vocabulary, Fashion scenes, feature cache, augmentation, canvas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vision_attn.data import fashion_mnist
from vision_attn.data.backgrounds import Background
from vision_attn.option_groups import OptionGroup, at_most, finite, require

KARPATHY_SPLITS = ("train", "val", "test")  # restval is always part of train


@dataclass(frozen=True)
class CocoLayout(OptionGroup):
    """Where a captioning dataset's files are, under the DataModule's ``root``: COCO captions files, one per split
    (``{split}`` in a pattern is the split's name), or Karpathy's ``dataset_coco.json`` (its restval joins train)."""

    name = "layout"
    annotation_format: Literal["coco", "karpathy"] = "coco"
    """coco: a captions file per split; karpathy: one dataset_coco.json with the splits"""
    train_split: str = "train"
    """the split that trains (Karpathy: train, with restval)"""
    val_split: str = "val"
    """the split that validates"""
    test_split: str = "test"
    """the split that tests"""
    captions_file_pattern: str = "annotations/captions_{split}.json"
    """a split's COCO captions file"""
    image_dir_pattern: str = "images/{split}"
    """a split's image folder"""
    instances_file_pattern: str = "annotations/instances_{split}.json"
    """a split's COCO instances file (objects and boxes: the scene metrics, and object_targets)"""
    attributes_file_pattern: str = "annotations/attributes_{split}.json"
    """a split's attributes file (the objects' colours)"""
    object_words: str | None = None
    """which caption words name which instance category, for the object metrics of validation and test (pointing,
    α mass, recall, CHAIR): coco (the 80 categories' words), scenes, or a JSON table (docs/formats/object-words.md);
    null: the scenes' class words, without CHAIR"""
    karpathy_file: str | None = None
    """Karpathy's split file (null: root/dataset_coco.json)"""
    karpathy_image_root: str | None = None
    """the folder the Karpathy file's filepaths start from (null: root)"""

    def check(self) -> None:
        """Refuse an unknown format, a placeholder other than {split}, or a split Karpathy's file does not have."""
        require(self.annotation_format in ("coco", "karpathy"), self.name,
                f"annotation_format must be 'coco' or 'karpathy', got {self.annotation_format!r}")
        for key in ("captions_file_pattern", "image_dir_pattern", "instances_file_pattern", "attributes_file_pattern"):
            try:
                getattr(self, key).format(split="train")
            except (KeyError, IndexError, ValueError):
                raise ValueError(f"{self.name}.{key} '{getattr(self, key)}' may only contain the placeholder "
                                 "{split}") from None
        if self.annotation_format == "karpathy":
            for key in ("train_split", "val_split", "test_split"):
                require(getattr(self, key) in KARPATHY_SPLITS, self.name,
                        f"{key} '{getattr(self, key)}' is not a Karpathy split; use one of {list(KARPATHY_SPLITS)} "
                        "(restval is always part of train)")

    @property
    def splits(self) -> dict[str, str]:
        """The split name that plays each role: train, val and test."""
        return {"train": self.train_split, "val": self.val_split, "test": self.test_split}


@dataclass(frozen=True)
class VocabularyOptions(OptionGroup):
    """The captioner's vocabulary: built from the training split's captions, or read from a file."""

    name = "vocabulary"
    min_word_count: int = 1
    """a word enters the vocabulary when the training captions use it this often (the rest are <unk>)"""
    max_caption_length: int = 24
    """training captions are cut to this many words (24 keeps every Fashion scenes caption whole)"""
    vocab_file: str | None = None
    """read the vocabulary from this JSON (as a fit writes it beside its checkpoints) instead of building it"""

    def check(self) -> None:
        """Refuse a minimum word count or a caption length below 1."""
        require(self.min_word_count >= 1, self.name, f"min_word_count must be at least 1, got {self.min_word_count}")
        require(self.max_caption_length >= 1, self.name,
                f"max_caption_length must be at least 1, got {self.max_caption_length}")
        at_most(self.name, "max_caption_length", self.max_caption_length, 200,
                "no caption is that long; each word costs memory in every batch")


@dataclass(frozen=True)
class SceneGeneration(OptionGroup):
    """Generating the Fashion scenes (``data/scenes.py``) into the DataModule's ``root`` when they are not there."""

    name = "scenes"
    generate: bool = False
    """write the scenes first when the root has none (scenes already there must be in the asked styles)"""
    counts: dict[str, int] | None = None
    """scenes per split (null: 20000 train, 1000 val, 1000 test)"""
    seed: int = 0
    """the generator's seed"""
    styles: dict[str, dict] | None = None
    """each split's style, e.g. {train: {layout: mixed, shade_jitter: 1.0}} (null: the formats page's scenes)"""

    def check(self) -> None:
        """Refuse scene counts that are not whole numbers of 0 or more."""
        require(self.counts is None or all(isinstance(v, int) and v >= 0 for v in self.counts.values()), self.name,
                f"counts must be whole numbers of 0 or more, got {self.counts}")
        for split, count in (self.counts or {}).items():
            at_most(self.name, f"counts.{split}", count, 100_000,
                    "five times the default training set; more scenes only fill the disk")


@dataclass(frozen=True)
class FeatureCacheOptions(OptionGroup):
    """A disk cache of what the model's frozen encoder part makes of each image (``data/feature_cache.py``): filled
    once (in parallel under DDP, or ahead with ``vision-attn cache-features``), then read instead of the images.
    Needs a task whose encoder is frozen, in whole or in its first stages (``encoder.trainable_stages``)."""

    name = "feature_cache"
    folder: str | None = None
    """where the cache's shards go (null: no cache)"""
    shard_size: int = 256
    """images per shard file"""

    def check(self) -> None:
        """Refuse a shard size below 1."""
        require(self.shard_size >= 1, self.name, f"shard_size must be at least 1, got {self.shard_size}")
        at_most(self.name, "shard_size", self.shard_size, 65536,
                "a shard is read whole; a larger one only costs memory")


@dataclass(frozen=True)
class Augmentation(OptionGroup):
    """Training-time augmentation of classification images, on whole batches."""

    name = "augmentation"
    pad_crop: int = 0
    """pad by this many pixels, then crop back at a random place (0: off)"""
    hflip: bool = False
    """mirror half the images left to right"""
    erase_prob: float = 0.0
    """the share of images that get a random rectangle erased (Zhong et al. 2020)"""

    def check(self) -> None:
        """Refuse a negative padding or an erase_prob outside [0, 1]."""
        require(self.pad_crop >= 0, self.name, f"pad_crop must be 0 or more pixels, got {self.pad_crop}")
        at_most(self.name, "pad_crop", self.pad_crop, 256,
                "a larger padding only costs memory: the crops are mostly padding")
        require(finite(self.erase_prob) and 0.0 <= self.erase_prob <= 1.0, self.name,
                f"erase_prob must be between 0 and 1, got {self.erase_prob}")


@dataclass(frozen=True)
class Canvas(OptionGroup):
    """Fashion-MNIST items pasted at a random place on a larger black square: a classifier that must find the item
    before it can name it, whose attention is scored against the item's mask."""

    name = "canvas"
    size: int = 56
    """the canvas's side in pixels (at least an item's 28)"""
    seed: int = 0
    """the seed of the validation and test items' fixed places"""
    train_window: int | None = None
    """train on a window this big round the item instead of the whole canvas (the ViT embeds only its patches)"""
    window_step: int = 8
    """windows start at multiples of this (set it to the ViT's patch size)"""
    background_noise: int = 0
    """training canvases get grey noise up to a level drawn per image from 0 to this (0..255) around the item"""
    background: str = "black"
    """training canvases' background around the item: black, noise, texture, distractors or mixed (the scenes')"""
    background_level: float = 0.5
    """the brightest the background is drawn, 0 to 1 of white"""
    background_weights: list[float] | None = None
    """background mixed: the odds of black, noise, texture and distractors (null: equal)"""
    texture_source: str = "skimage"
    """background texture: the photographs shipped with skimage (scikit-image) or matplotlib"""
    scale: list[float] | None = None
    """training items resized to a side drawn per item from this range of their 28 pixels, e.g. [0.6, 1.15]
    (null: as they are)"""

    def check(self) -> None:
        """Refuse a bad noise level, background or scale, a canvas below an item, a window not reaching every
        place."""
        item = fashion_mnist.ITEM_SIZE
        if self.scale is not None:
            require(len(self.scale) == 2 and all(map(finite, self.scale)) and 0 < self.scale[0] <= self.scale[1],
                    self.name, f"scale is [low, high] with 0 < low <= high, got {self.scale}")
            side, room = fashion_mnist.scaled_side(self.scale[1]), self.train_window or self.size
            require(fashion_mnist.scaled_side(self.scale[0]) >= 1 and side <= room, self.name,
                    f"scale {self.scale} draws items of up to {side} pixels: they must fit the training "
                    f"{'window' if self.train_window else 'canvas'} ({room} pixels), and be 1 pixel or more")
        require(0 <= self.background_noise <= 255, self.name,
                f"background_noise is a grey level from 0 to 255, got {self.background_noise}")
        require(not (self.background_noise and self.background != "black"), self.name,
                "background_noise is grey noise on black: set it or background, not both")
        self.background_spec().check(f"{self.name}.background")
        require(self.size >= item, self.name, f"size must be at least {item} (an item's side), got {self.size}")
        at_most(self.name, "size", self.size, 1024,
                "a 28-pixel item is a speck on a larger canvas, which only costs memory")
        window, step = self.train_window, self.window_step
        require(window is None or (step >= 1 and item + step - 1 <= window <= self.size
                                   and (self.size - window) % step == 0), self.name,
                f"train_window must be from {item} + window_step - 1 to size, and size minus it a multiple of "
                f"window_step, so that windows reach every place: got train_window {window}, window_step {step}, "
                f"size {self.size}")

    def background_spec(self) -> Background:
        """The training canvases' background (``data.backgrounds``)."""
        weights = None if self.background_weights is None else tuple(self.background_weights)
        return Background(self.background, self.background_level, self.texture_source, weights)
