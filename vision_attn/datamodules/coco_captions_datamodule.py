"""The captioning DataModule: COCO-format caption files (MS COCO, the Fashion scenes) or Karpathy's splits. The
vocabulary, from the training split, exists right after construction, so LightningCLI can link it into the model."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from torch import Tensor

from vision_attn.captioning.options import ObjectNames
from vision_attn.data.caption_datasets import (
    CaptionBatch,
    CaptionEvalDataset,
    CaptionTrainDataset,
    EvalCaptionBatch,
    collate_captions,
    collate_references,
)
from vision_attn.data.coco import (
    CaptionedImage,
    ObjectTargets,
    load_caption_image,
    read_coco_captions,
    read_instances,
    read_karpathy,
    read_object_targets,
)
from vision_attn.data.feature_cache import FeatureCache, FrozenPart, fill_caches, split_caches
from vision_attn.data.formats import read_json
from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD, load_or_skip
from vision_attn.data.object_words import object_words
from vision_attn.data.scenes import SPLIT_CODES, SceneStyle, make_scenes
from vision_attn.data.vocabulary import SPECIALS, Vocabulary
from vision_attn.datamodules.data_options import CocoLayout, FeatureCacheOptions, SceneGeneration, VocabularyOptions
from vision_attn.datamodules.split_datamodule import SplitDataModule
from vision_attn.errors import DatasetNotFoundError
from vision_attn.io import output_folder, writable_folder
from vision_attn.option_groups import Loader

log = logging.getLogger(__name__)
# The splits (by role) each Lightning stage reads; the training split's captions give the vocabulary in every stage
STAGE_ROLES = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}


class CocoCaptionsDataModule(SplitDataModule):
    """Image captioning data in COCO captions format (MS COCO, the Fashion scenes) or Karpathy's splits, where
    ``layout`` says, under ``root`` (which the config names: no dataset is a default). Images are squashed to
    ``image_size`` squares and normalised with ``mean`` and ``std`` (ImageNet's by default).

    Args:
        root: the dataset's folder (the layout's paths are under it)
        image_size: images are squashed to squares of this many pixels
        mean: per-channel mean the images are normalised with (null: ImageNet's)
        std: per-channel standard deviation the images are normalised with (null: ImageNet's)
        group_captions: a training item is an image with all its captions (batch_size counts images)
        object_targets: give training images their objects (boxes, classes, colours) from the instances file
    """

    collate_fns = (collate_captions, collate_references)  # every caption (and evaluation image) once per epoch

    def __init__(self, root: str, *, layout: CocoLayout = CocoLayout(), image_size: int = 96,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 vocabulary: VocabularyOptions = VocabularyOptions(), loader: Loader = Loader(batch_size=64),
                 group_captions: bool = False, object_targets: bool = False,
                 scenes: SceneGeneration = SceneGeneration(),
                 feature_cache: FeatureCacheOptions = FeatureCacheOptions()) -> None:
        super().__init__(Loader.coerce(loader))
        self.layout, self.feature_cache = CocoLayout.coerce(layout), FeatureCacheOptions.coerce(feature_cache)
        self.vocabulary_options, scenes = VocabularyOptions.coerce(vocabulary), SceneGeneration.coerce(scenes)
        if self.feature_cache.folder:
            output_folder(self.feature_cache.folder)  # not a file, not under one: refused before any work
        if image_size < 1:
            raise ValueError(f"image_size must be at least 1, got {image_size}")
        self.root, self.splits = Path(root), self.layout.splits
        self.karpathy_file = Path(self.layout.karpathy_file or self.root / "dataset_coco.json")
        self.karpathy_image_root = Path(self.layout.karpathy_image_root or self.root)
        self.image_size, self.in_chans, self.group_captions = image_size, 3, group_captions
        self.mean, self.std = list(IMAGENET_MEAN if mean is None else mean), list(IMAGENET_STD if std is None else std)
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ValueError(f"mean and std need 3 values each (RGB), got {self.mean} and {self.std}")
        self._records: dict[str, list[CaptionedImage]] = {}
        self._sizes: dict[str, dict[Any, tuple[int, int] | None]] = {}  # per role, each image's file size
        self._style_mismatches: dict[str, str] = {}  # per role, why its scenes are not in the asked style
        self.object_words = object_words(self.layout.object_words) if self.layout.object_words else None
        if scenes.generate:
            self._generate_scenes(scenes)
        self.vocab = self._vocabulary()
        self._objects: ObjectTargets | None = self._read_object_targets() if object_targets else None
        self.object_classes = list(self._objects.classes) if self._objects else []
        self.object_colours = list(self._objects.colours) if self._objects else []

    def _vocabulary(self) -> Vocabulary:
        # the vocabulary file's, or the training captions' words used at least min_word_count times
        options = self.vocabulary_options
        if options.vocab_file:
            return Vocabulary.from_json(options.vocab_file)
        train_captions = [caption for record in self.records("train") for caption in record.captions]
        vocab = Vocabulary.build(train_captions, min_count=options.min_word_count)
        if len(vocab) == len(SPECIALS):
            raise ValueError(f"vocabulary.min_word_count {options.min_word_count} keeps no word of the "
                             f"{len(train_captions)} {self.splits['train']} captions: a captioner needs words; "
                             "lower it")
        log.info("vocabulary of %d tokens from the %s split (min count %d)", len(vocab), self.splits["train"],
                 options.min_word_count)
        return vocab

    @property
    def object_names(self) -> ObjectNames:
        """The classes and colours of the training objects (``object_targets``), for the CLI to link into the model."""
        words = [self.object_words.single_words(name) for name in self.object_classes] \
            if self.object_words is not None else []
        return ObjectNames(classes=list(self.object_classes), colours=list(self.object_colours), class_words=words)

    def _read_object_targets(self) -> ObjectTargets:
        if self.layout.annotation_format != "coco":
            raise ValueError("object_targets needs layout.annotation_format 'coco' with an instances file for the "
                             "train split (layout.instances_file_pattern)")
        split = self.splits["train"]
        instances = self.root / self.layout.instances_file_pattern.format(split=split)
        if not instances.is_file():
            raise DatasetNotFoundError(f"{instances}: no instances file for the {split} split, which "
                                       "object_targets reads")
        attributes = self.root / self.layout.attributes_file_pattern.format(split=split)
        objects = read_object_targets(instances, attributes if attributes.is_file() else None)
        log.info("object targets of %d %s images: %d classes, %d colours", len(objects.per_image), split,
                 len(objects.classes), len(objects.colours))
        return objects

    @property
    def vocab_size(self) -> int:
        """V, the number of tokens in the vocabulary, specials included."""
        return len(self.vocab)

    @property
    def vocab_tokens(self) -> list[str]:
        """The vocabulary as a plain token list (specials first), for the CLI to link into the model."""
        return self.vocab.tokens

    def save_vocab(self, path: str | Path) -> None:
        """Write the vocabulary as JSON (``vocabulary.vocab_file`` reads it back)."""
        self.vocab.to_json(path)

    def save_files(self, folder: Path) -> None:
        """What a fit keeps beside its checkpoints: ``vocab.json`` (the checkpoints hold the words too)."""
        self.save_vocab(folder / "vocab.json")

    def captions_file(self, split: str) -> Path:
        """The COCO captions file of the split named ``split`` (``layout.captions_file_pattern``)."""
        return self.root / self.layout.captions_file_pattern.format(split=split)

    def image_dir(self, split: str) -> Path:
        """The image folder of the split named ``split`` (``layout.image_dir_pattern``)."""
        return self.root / self.layout.image_dir_pattern.format(split=split)

    def _generate_scenes(self, scenes: SceneGeneration) -> None:
        if self.layout.annotation_format != "coco":
            raise ValueError("scenes.generate needs layout.annotation_format 'coco' (the scenes are COCO-format "
                             "files)")
        styles = {split: SceneStyle.of(style) for split, style in (scenes.styles or {}).items()}
        unknown = set(styles) - set(SPLIT_CODES)
        if unknown:
            raise ValueError(f"scenes.styles names split(s) {sorted(unknown)}; use {list(SPLIT_CODES)}")
        missing = [split for split in self.splits.values() if not self.captions_file(split).is_file()]
        if missing:
            log.info("no Fashion scenes in %s (missing %s): generating them", self.root,
                     ", ".join(str(self.captions_file(split)) for split in missing))
            for split, written in make_scenes(self.root, counts=scenes.counts, seed=scenes.seed, styles=styles).items():
                log.info("wrote %d %s scenes with %d captions", written["images"], split, written["captions"])
            return
        for role, split in self.splits.items():  # scenes already there: each split a stage reads is checked then
            data = read_json(self.captions_file(split), "a COCO captions JSON")
            info = data.get("info") if isinstance(data, dict) else None
            found = SceneStyle.of(info.get("style") if isinstance(info, dict) else None)
            differences = found.differences(styles.get(split, SceneStyle()))
            if differences:
                drawn, asked = (", ".join(f"{name} {values[side]}" for name, values in differences.items())
                                for side in (0, 1))
                self._style_mismatches[role] = (
                    f"{self.captions_file(split)}: the {split} scenes were drawn with {drawn}, but "
                    f"data.init_args.scenes.styles asks for {asked}; ask for the style they were drawn in, or point "
                    "data.init_args.root at scenes drawn as asked")

    def require_styles(self, roles: Sequence[str]) -> None:
        """Refuse in one line generated scenes of the splits playing ``roles`` drawn in another style than asked."""
        for role in roles:
            if role in self._style_mismatches:
                raise ValueError(self._style_mismatches[role])

    def records(self, role: Literal["train", "val", "test"]) -> list[CaptionedImage]:
        """The captioned images of the split playing ``role``, read once; validation and test images carry their
        objects when the split has an instances file."""
        if role not in self._records:
            if self.layout.annotation_format == "coco":
                split = self.splits[role]
                self._records[role] = read_coco_captions(self.captions_file(split), self.image_dir(split))
            else:
                self._records.update(read_karpathy(self.karpathy_file, self.karpathy_image_root))
                if not self._records[role]:
                    raise ValueError(f"{self.karpathy_file}: no images in the {role} split")
            instances = self.root / self.layout.instances_file_pattern.format(split=self.splits[role])
            attributes = self.root / self.layout.attributes_file_pattern.format(split=self.splits[role])
            if role != "train" and instances.is_file():
                found = read_instances(instances, attributes if attributes.is_file() else None)
                self._sizes[role] = found.sizes
                self._records[role] = [replace(record, objects=found.objects.get(record.image_id, []))
                                       for record in self._records[role]]
        return self._records[role]

    def box_scale(self, role: Literal["val", "test"]) -> dict[Any, tuple[float, float]]:
        """Per image id of the split playing ``role``, (sx, sy) from its instances' pixels to the squashed input."""
        self.records(role)
        return {image_id: (self.image_size / size[0], self.image_size / size[1])
                for image_id, size in self._sizes.get(role, {}).items() if size}

    def setup(self, stage: str | None = None) -> None:
        """The datasets the stage reads (train and val for fit), with a feature cache their cached features."""
        self.require_styles(STAGE_ROLES.get(stage, ("train", "val", "test")))
        options = {"image_size": self.image_size, **self.bad_image_options}
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = CaptionTrainDataset(self.records("train"), self.vocab, group_captions=self.group_captions,
                                                 max_caption_length=self.vocabulary_options.max_caption_length,
                                                 objects=self._objects, **options)
        if stage in (None, "fit", "validate") and self.val_set is None:
            self.val_set = CaptionEvalDataset(self.records("val"), **options)
        if stage in (None, "test", "predict") and self.test_set is None:
            self.test_set = CaptionEvalDataset(self.records("test"), **options)
        if self.feature_cache.folder and self.trainer is not None:
            self._serve_cached_features(stage)

    def _serve_cached_features(self, stage: str | None) -> None:
        # fill the caches of the splits this stage reads, each rank its share, and serve them instead of images
        trainer = self.trainer
        part = getattr(trainer.lightning_module, "frozen_encoder_part", lambda: None)()
        if part is None:
            raise ValueError("feature_cache needs a frozen encoder, whose output never changes: set the model's "
                             "encoder.trainable_stages to 0 (all frozen) or to fewer stages than the trunk has")
        roles = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), None: ("train", "val", "test")}
        caches = self.feature_caches(part, roles.get(stage, ()))
        self.fill_feature_caches(part, caches, rank=trainer.global_rank, world_size=trainer.world_size,
                                 device=trainer.strategy.root_device, barrier=trainer.strategy.barrier,
                                 progress=trainer.is_global_zero)
        for role, cache in caches.items():
            self.use_feature_cache(role, cache)

    def feature_caches(self, part: FrozenPart, roles: Sequence[str]) -> dict[str, FeatureCache]:
        """The feature cache of each ``role`` split's images under ``part`` (``data.feature_cache.split_caches``)."""
        self.require_styles(roles)
        return split_caches(part, {role: [record.path for record in self.records(role)] for role in roles},
                            self.feature_cache.folder, image_size=self.image_size, mean=self.mean, std=self.std,
                            shard_size=self.feature_cache.shard_size)

    def fill_feature_caches(self, part: FrozenPart, caches: dict[str, FeatureCache], **where: Any) -> None:
        """Fill this rank's share of ``caches`` (``data.feature_cache.fill_caches``; ``where``: rank, world size,
        device, barrier, progress); an unwritable folder is refused before any work."""
        if any(cache.missing() for cache in caches.values()):
            writable_folder(self.feature_cache.folder)
        def load(role: str, index: int) -> Tensor | None:
            path = self.records(role)[index].path
            return load_or_skip(lambda: load_caption_image(path, self.image_size), self.loader.on_bad_image, None)
        fill_caches(part, caches, load=load, normalize=self.normalize, batch_size=self.loader.eval_size, **where)

    def prepare_batch(self, batch: CaptionBatch | EvalCaptionBatch) -> CaptionBatch | EvalCaptionBatch:
        """The batch with its images normalised on the device; cached features (not pixels) pass as they are."""
        return batch if batch.features else batch._replace(images=self.normalize(batch.images))

    def use_feature_cache(self, role: Literal["train", "val", "test"], cache: FeatureCache | None) -> None:
        """Serve the ``role`` split's cached features (all its images, in order) instead of its images (None: not)."""
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[role]
        if dataset is None:
            raise ValueError(f"the {role} split is not set up: call setup() first")
        if cache is not None and cache.count != len(self.records(role)):
            raise ValueError(f"a feature cache of {cache.count} images for the {len(self.records(role))} of {role}")
        dataset.features = cache
