"""Captioning image files or a COCO-format split with a trained checkpoint, with attention traces."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from vision_attn.captioning.module import ShowAttendTell
from vision_attn.checkpoint import load_module
from vision_attn.data.coco import load_caption_image, read_coco_captions
from vision_attn.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.images import BadImageCounter, OnBadImage, normalize, readable_batches


def load_captioner(path: str | os.PathLike, *, device: str = "cpu", loaded: dict | None = None) -> ShowAttendTell:
    """A ShowAttendTell from a checkpoint, in eval mode on ``device``."""
    return load_module(ShowAttendTell, path, kind="captioner", loaded=loaded).to(device).eval()


def coco_inputs(annotations: str | os.PathLike, image_dir: str | os.PathLike) -> list[tuple[int | str, Path]]:
    """(COCO image id, path) for every captioned image of a COCO captions file."""
    return [(record.image_id, record.path) for record in read_coco_captions(Path(annotations), Path(image_dir))]


@torch.inference_mode()
def caption_files(
    module: ShowAttendTell,
    inputs: Sequence[tuple[Any, Path]],
    *,
    beam_size: int | None = None,
    batch_size: int = 32,
    on_bad_image: OnBadImage = "error",
    bad_images: BadImageCounter | None = None,
) -> Iterator[dict[str, Any]]:
    """SPEC §4 records, one per readable (image id, path), in order. An unreadable image raises
    BadImageError naming it, or with ``on_bad_image="skip"`` is left out with a warning and counted."""
    size = module.hparams.image_size
    mean, std = module.hparams.mean or IMAGENET_MEAN, module.hparams.std or IMAGENET_STD
    for chunk, pixels in readable_batches(inputs, lambda item: load_caption_image(item[1], size),
                                          batch_size=batch_size, on_bad_image=on_bad_image, bad_images=bad_images):
        images = normalize(pixels.to(module.device), mean, std)  # (B, 3, S, S)
        hypotheses, grid = module.decode(images, beam_size=beam_size)
        for (image_id, path), hypothesis in zip(chunk, hypotheses, strict=True):
            yield module.to_record(image_id, hypothesis, grid, (size, size), file_name=str(path))
