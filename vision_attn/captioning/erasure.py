"""Does the captioner's α point at what makes it say the word? An erasure test (``docs/formats/metrics.md``).

At each class word a caption emits, the object whose box holds α's argmax cell (the attended object) is erased
(filled with the scene's background), and, in a second image, another object; the caption is re-scored by teacher
forcing on both. If α shows what the word rests on, erasing the attended object lowers the word's
log-probability more than erasing the other.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.evaluation import nulls_for_nan
from vision_attn.data.coco import load_caption_image, load_coco, resolve_inside
from vision_attn.data.images import OnBadImage, normalize, readable_batches
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID
from vision_attn.errors import DatasetNotFoundError
from vision_attn.io import write_json_atomically
from vision_attn.metrics import pointed_box

# (uint8 images (N, 3, S, S), captions (N, T+1) = <start> w_1 .. <end> <pad>..) -> log p(captions[:, 1:]) (N, T)
Scorer = Callable[[Tensor, Tensor], Tensor]
Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in the network input's pixels
SKIPS = ("single_object", "no_attended_object")  # why a class word was not scored


class WordErasure(NamedTuple):
    """A scored class word, the two objects erased, its log-probability on the image, and how much erasing the
    attended object, then the other, lowers it."""

    image_id: Any
    position: int
    word: str
    attended: str
    other: str
    log_prob: float
    drop_attended: float
    drop_other: float


def erase_box(image: Tensor, background: Tensor, box: Box) -> Tensor:
    """A copy of ``image`` (C, H, W) with the pixels ``box`` touches taken from ``background`` (C, H, W)."""
    x0, y0, x1, y1 = box
    left, top = max(int(math.floor(x0)), 0), max(int(math.floor(y0)), 0)
    right, bottom = min(int(math.ceil(x1)), image.shape[-1]), min(int(math.ceil(y1)), image.shape[-2])
    erased = image.clone()
    erased[..., top:bottom, left:right] = background[..., top:bottom, left:right]
    return erased


class Planned(NamedTuple):
    """A class word to score: its image (index in the batch), position, word, and the two objects to erase."""

    image: int
    position: int
    word: str
    attended: int
    other: int


def plan_erasures(words: Sequence[Sequence[str]], alphas: Sequence[Tensor],
                  objects: Sequence[Sequence[tuple[str, Box]]], *, grid: tuple[int, int],
                  image_size: tuple[int, int], class_words: set[str],
                  image_ids: Sequence[Any], seed: int = 0) -> tuple[list[Planned], Counter]:
    """The class words of a batch's captions to score, and the skips (``SKIPS``) counted; the other object is drawn
    among the rest, seeded by ``seed``, the image id and the position (not by the batch)."""
    planned, skipped = [], Counter({reason: 0 for reason in SKIPS})
    for index, (caption, alpha_rows, scene) in enumerate(zip(words, alphas, objects, strict=True)):
        boxes = [box for _, box in scene]
        for position, word in enumerate(caption):
            if word not in class_words:
                continue
            attended = pointed_box(alpha_rows[position], grid, image_size, boxes)  # the attended object
            if attended is None:
                skipped["no_attended_object"] += 1
                continue
            others = [i for i in range(len(scene)) if i != attended]
            if not others:
                skipped["single_object"] += 1
                continue
            other = random.Random(f"{seed}/{image_ids[index]}/{position}").choice(others)
            planned.append(Planned(index, position, word, attended, other))
    return planned, skipped


def erase_and_score(score: Scorer, pixels: Tensor, backgrounds: Tensor, captions: Tensor, planned: Sequence[Planned],
                    objects: Sequence[Sequence[tuple[str, Box]]], image_ids: Sequence[Any]) -> list[WordErasure]:
    """Score ``planned`` words in one ``score`` call: the images (B, 3, S, S) with their ``captions`` (B, T+1), then
    per word its image with each object erased (from ``backgrounds``)."""
    if not planned:
        return []
    erased = [erase_box(pixels[p.image], backgrounds[p.image], objects[p.image][which][1])
              for p in planned for which in (p.attended, p.other)]
    images = torch.cat([pixels, torch.stack(erased)])
    rows = torch.tensor([p.image for p in planned for _ in range(2)])
    captions = captions[:, : max(p.position for p in planned) + 2]  # the words after the last one scored: unread
    log_probs = score(images, torch.cat([captions, captions[rows]])).float().cpu()  # (B + 2K, T)
    found = []
    for index, p in enumerate(planned):
        base, erased_rows = float(log_probs[p.image, p.position]), log_probs[len(pixels) + 2 * index:, p.position]
        found.append(WordErasure(image_ids[p.image], p.position, p.word, objects[p.image][p.attended][0],
                                 objects[p.image][p.other][0], base, base - float(erased_rows[0]),
                                 base - float(erased_rows[1])))
    return found


def summarise(words: Sequence[WordErasure], *, images: int, skipped: Mapping[str, int]) -> dict[str, Any]:
    """The measures (``docs/formats/metrics.md``): the share of words the attended object's erasure lowers more (a
    tie is not), the mean drops, the share whose attended object is the one named, and the counts."""
    count, nan = len(words), float("nan")
    mean = (lambda values: sum(values) / count) if count else (lambda values: nan)
    return {"images": images, "words": count, "skipped": {reason: int(skipped.get(reason, 0)) for reason in SKIPS},
            "attended_drop_larger": mean([float(w.drop_attended > w.drop_other) for w in words]),
            "mean_drop_attended": mean([w.drop_attended for w in words]),
            "mean_drop_other": mean([w.drop_other for w in words]),
            "attended_is_named": mean([float(w.attended == w.word) for w in words])}


def captioner_scorer(captioner: Captioner) -> Scorer:
    """The ``Scorer`` of a captioner: its teacher-forced log-probability of each caption token."""
    @torch.inference_mode()
    def score(pixels: Tensor, captions: Tensor) -> Tensor:
        images = normalize(pixels.to(captioner.device), captioner.mean, captioner.std)
        captions = captions.to(captioner.device)
        logits = captioner(images, captions).logits.float()  # (N, T, V), one encoder pass for all N
        return logits.gather(2, captions[:, 1:, None]).squeeze(2) - logits.logsumexp(-1)  # no second (N, T, V)
    return score


class Scene(NamedTuple):
    """A scene to test: id, file, background file (``backgrounds/<split>/``; None: black), objects (name, box in
    the file's pixels) and size."""

    image_id: Any
    path: Path
    background: Path | None
    objects: list[tuple[str, Box]]
    size: tuple[int, int]  # (width, height)


def read_scenes(root: str | os.PathLike, split: str, count: int | None = None) -> tuple[list[Scene], set[str]]:
    """The first ``count`` images (None: all) of a Fashion scenes split, and the instances' category names, read
    and checked before any work."""
    root = Path(root)
    instances = root / "annotations" / f"instances_{split}.json"
    if not root.is_dir():
        raise DatasetNotFoundError(f"{root}: no such folder (a Fashion scenes root, as `vision-attn make-scenes` "
                                   "writes)")
    if not instances.is_file():
        raise DatasetNotFoundError(f"{instances}: not found; is {root} a Fashion scenes root with a {split} split?")
    coco = load_coco(instances, "instances")
    names = {category["id"]: category["name"] for category in coco.cats.values()}
    scenes = []
    for image_id, image in list(coco.imgs.items())[:count]:
        if "width" not in image or "height" not in image:
            raise ValueError(f"{instances}: image {image_id!r} has no width and height, which placing its boxes "
                             "on the network input needs")
        boxes = [(names[a["category_id"]], (a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2],
                                            a["bbox"][1] + a["bbox"][3])) for a in coco.imgToAnns.get(image_id, [])]
        path = resolve_inside(root / "images" / split, image.get("file_name"), source=instances)
        background = resolve_inside(root / "backgrounds" / split, image["file_name"], source=instances)
        scenes.append(Scene(image_id, path, background if background.is_file() else None, boxes,
                            (image["width"], image["height"])))
    if not scenes:
        raise ValueError(f"{instances}: holds no images")
    return scenes, set(names.values())


def scene_pixels(scene: Scene, size: int) -> Tensor:
    """The image and its background as the captioner sees them: uint8 (2, 3, size, size); black without one."""
    image = load_caption_image(scene.path, size)
    background = torch.zeros_like(image) if scene.background is None else load_caption_image(scene.background, size)
    return torch.stack([image, background])


def caption_ids(tokens: Sequence[Sequence[int]]) -> Tensor:
    """Captions as padded ids (B, T+1): <start> w_1 .. w_n <end> <pad>.."""
    return pad_sequence([torch.tensor([START_ID, *ids, END_ID]) for ids in tokens], batch_first=True,
                        padding_value=PAD_ID)


class ErasureReport(NamedTuple):
    """What ``erasure_test`` found: the measures (``summarise``) and every scored word."""

    summary: dict[str, Any]
    words: list[WordErasure]


def erasure_test(checkpoint: str | os.PathLike, root: str | os.PathLike, *, split: str = "test",
                 count: int | None = None, beam_size: int | None = None, batch_size: int = 16, seed: int = 0,
                 device: str = "cpu", on_bad_image: OnBadImage = "error",
                 on_batch: Callable[[int, int], None] | None = None) -> ErasureReport:
    """The erasure test of a checkpoint on the first ``count`` scenes of a split (None: all): per batch of readable
    scenes, captioned, then scored in one pass with all its erasures; ``on_batch`` sees each batch's image count and
    the total."""
    scenes, class_words = read_scenes(root, split, count)
    captioner = Captioner.from_checkpoint(checkpoint, device=device)
    size, score = captioner.image_size, captioner_scorer(captioner)
    words, skipped, images = [], Counter(), 0
    for chunk, loaded in readable_batches(scenes, lambda scene: scene_pixels(scene, size), batch_size=batch_size,
                                          on_bad_image=on_bad_image):
        pixels, backgrounds = loaded[:, 0], loaded[:, 1]
        with torch.inference_mode():
            decoded = captioner.decode(normalize(pixels.to(captioner.device), captioner.mean, captioner.std),
                                       beam_size=beam_size)
        hypotheses, ids = decoded.hypotheses, [scene.image_id for scene in chunk]
        objects = [[(name, tuple(v * (size / scene.size[i % 2]) for i, v in enumerate(box)))
                    for name, box in scene.objects] for scene in chunk]  # boxes in the input's pixels (squashed)
        planned, skips = plan_erasures([captioner.words(h) for h in hypotheses], [h.alphas for h in hypotheses],
                                       objects, grid=decoded.grid, image_size=(size, size), class_words=class_words,
                                       image_ids=ids, seed=seed)
        words += erase_and_score(score, pixels, backgrounds, caption_ids([h.tokens for h in hypotheses]), planned,
                                 objects, ids)
        images += len(chunk)
        skipped.update(skips)
        if on_batch is not None:
            on_batch(len(chunk), len(scenes))
    summary = summarise(words, images=images, skipped=skipped)
    summary.update(split=split, backgrounds=sum(scene.background is not None for scene in scenes),
                   beam_size=beam_size or captioner.decoding.beam_size)
    return ErasureReport(summary, words)


def write_erasure(out: str | os.PathLike, report: ErasureReport) -> Path:
    """The report as JSON: the summary's fields, then ``records``, one per scored word (its drops rounded)."""
    records = [{"image_id": w.image_id, "position": w.position, "word": w.word, "attended": w.attended,
                "other": w.other, "log_prob": round(w.log_prob, 6), "drop_attended": round(w.drop_attended, 6),
                "drop_other": round(w.drop_other, 6)} for w in report.words]
    return write_json_atomically(out, {**nulls_for_nan(report.summary), "records": records})
