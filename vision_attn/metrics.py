"""Caption metrics the COCO way, and whether attention points at the object a word names (SPEC §5).

- BLEU-1..4, METEOR, ROUGE-L and CIDEr-D from pycocoevalcap, each image scored once. SPICE is left out:
  it needs a Stanford CoreNLP download that cannot happen offline. Without Java, METEOR and the PTB
  tokenizer are skipped with one warning and the other metrics still computed.
- Pointing accuracy: for every emitted class word whose class is in the scene, does the centre of α_t's
  argmax cell fall inside that object's box, grown by half a grid cell on each side; and the α mass in the box.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from vision_attn.captioning.vocabulary import tokenize

log = logging.getLogger(__name__)

CLASS_WORDS = ("top", "trousers", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def java_available() -> bool:
    return shutil.which("java") is not None


def deduplicate(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One result per image id, the first seen: DDP samplers pad ranks with repeated images."""
    seen: dict[Any, dict[str, Any]] = {}
    for result in results:
        seen.setdefault(result["image_id"], dict(result))
    return list(seen.values())


def _simple_tokenize(captions: Mapping[Any, Sequence[str]]) -> dict[Any, list[str]]:
    return {key: [" ".join(tokenize(c)) for c in values] for key, values in captions.items()}


def caption_scores(predictions: Mapping[Any, str], references: Mapping[Any, Sequence[str]]) -> dict[str, float]:
    """Corpus BLEU-1..4, METEOR, ROUGE-L and CIDEr-D of one caption per image against its references."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    missing = [key for key in predictions if key not in references]
    if missing:
        raise ValueError(f"{len(missing)} predicted images have no references, e.g. image id {missing[0]!r}")
    if not predictions:
        raise ValueError("no predictions to score")
    _warn_once("spice", "SPICE is not computed: it needs a Stanford CoreNLP download, impossible offline")
    gts = {key: list(references[key]) for key in predictions}
    res = {key: [predictions[key]] for key in predictions}
    use_java = java_available()
    if use_java:
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        tokenizer = PTBTokenizer()
        gts = tokenizer.tokenize({k: [{"caption": c} for c in v] for k, v in gts.items()})
        res = tokenizer.tokenize({k: [{"caption": c} for c in v] for k, v in res.items()})
    else:
        _warn_once("java", "Java not found: METEOR and the PTB tokenizer are skipped; the other metrics use "
                           "vision-attn's tokenizer (apt-get install default-jre-headless to get them)")
        gts, res = _simple_tokenize(gts), _simple_tokenize(res)
    scores: dict[str, float] = {}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    for n, value in enumerate(bleu, start=1):
        scores[f"BLEU-{n}"] = float(value)
    if use_java:
        from pycocoevalcap.meteor.meteor import Meteor

        meteor = Meteor()  # a Java subprocess, ended when the scorer is garbage-collected
        scores["METEOR"] = float(meteor.compute_score(gts, res)[0])
        del meteor
    scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
    return scores


def pointing_scores(
    records: Iterable[Mapping[str, Any]],
    boxes: Mapping[Any, Sequence[tuple[str, Sequence[float]]]],
    *,
    box_scale: Mapping[Any, tuple[float, float]] | None = None,
    class_words: Sequence[str] = CLASS_WORDS,
) -> dict[str, float]:
    """Pointing accuracy and mean α mass in the box over the class words of SPEC §4 records.

    ``records`` hold ``image_id``, ``tokens``, ``grid`` [Gh, Gw], ``image_size`` [H, W] and ``alphas`` (one
    row per token). ``boxes`` maps an image id to (class word, [x, y, w, h]) in the pixels of the image the
    network saw, or in the original image's pixels with ``box_scale`` giving (sx, sy) to the network input.
    """
    hits, masses, counted = 0, 0.0, 0
    words = set(class_words)
    for record in records:
        objects = {word: box for word, box in boxes.get(record["image_id"], [])}
        grid_h, grid_w = record["grid"]
        height, width = record["image_size"]
        cell_h, cell_w = height / grid_h, width / grid_w
        scale_x, scale_y = (box_scale or {}).get(record["image_id"], (1.0, 1.0))
        alphas = torch.as_tensor(record["alphas"], dtype=torch.float64)
        for t, token in enumerate(record["tokens"]):
            if token not in words or token not in objects:
                continue
            x, y, w, h = objects[token]
            x0, y0, x1, y1 = x * scale_x, y * scale_y, (x + w) * scale_x, (y + h) * scale_y
            alpha = alphas[t].view(grid_h, grid_w)  # (L,) -> (Gh, Gw)
            row, col = divmod(int(alpha.argmax()), grid_w)
            centre_x, centre_y = (col + 0.5) * cell_w, (row + 0.5) * cell_h
            inside_x = x0 - cell_w / 2 <= centre_x <= x1 + cell_w / 2  # the box grown by half a cell
            inside_y = y0 - cell_h / 2 <= centre_y <= y1 + cell_h / 2
            hits += inside_x and inside_y
            # α mass in the box: each cell's α spread evenly over the cell, times the cell's overlap with the box
            lefts = torch.arange(grid_w, dtype=torch.float64) * cell_w
            tops = torch.arange(grid_h, dtype=torch.float64) * cell_h
            overlap_x = ((lefts + cell_w).clamp(max=x1) - lefts.clamp(min=x0)).clamp(min=0) / cell_w  # (Gw,)
            overlap_y = ((tops + cell_h).clamp(max=y1) - tops.clamp(min=y0)).clamp(min=0) / cell_h  # (Gh,)
            masses += float((alpha * overlap_y[:, None] * overlap_x[None, :]).sum())
            counted += 1
    if counted == 0:
        return {"pointing_accuracy": float("nan"), "alpha_mass_in_box": float("nan"), "pointing_words": 0.0}
    return {"pointing_accuracy": hits / counted, "alpha_mass_in_box": masses / counted,
            "pointing_words": float(counted)}


def pointing_by_mention(
    records: Iterable[Mapping[str, Any]],
    boxes: Mapping[Any, Sequence[tuple[str, Sequence[float]]]],
    *,
    class_words: Sequence[str] = CLASS_WORDS,
) -> dict[tuple[int, int], dict[str, float]]:
    """``pointing_scores`` split by (objects in the scene, mention): the n-th class word of each caption.

    A diagnostic: when the references name a scene's objects in every order, the first mentions are the
    ones whose object the decoder had to choose before emitting them.
    """
    words = set(class_words)
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for record in records:
        objects = len(boxes.get(record["image_id"], []))
        mention = 0
        for t, token in enumerate(record["tokens"]):
            if token not in words:
                continue
            mention += 1
            only_this = [word if i == t else "" for i, word in enumerate(record["tokens"])]
            groups.setdefault((objects, mention), []).append({**record, "tokens": only_this})
    return {key: pointing_scores(groups[key], boxes, class_words=class_words) for key in sorted(groups)}


def mask_mass(weights: Tensor, masks: Tensor) -> Tensor:
    """SPEC §5, ViT: the share of a map's mass on the object, per image.

    ``weights`` (B, Gh, Gw) is a map over the patch grid (e.g. rollout), ``masks`` (B, H, W) the object's
    pixels in the network input (H, W multiples of the grid). Each cell's weight counts in proportion to the
    share of its pixels inside the mask. A map that ignores the object scores the mask's area share.
    """
    if masks.shape[-2] % weights.shape[-2] or masks.shape[-1] % weights.shape[-1]:
        raise ValueError(f"a {tuple(masks.shape[-2:])} mask does not tile a {tuple(weights.shape[-2:])} grid")
    coverage = torch.nn.functional.adaptive_avg_pool2d(masks.float()[:, None], weights.shape[-2:])[:, 0]
    weights = weights.clamp(min=0)
    weights = weights / weights.sum(dim=(-2, -1), keepdim=True).clamp_min(1e-12)
    return (weights * coverage).sum(dim=(-2, -1))
