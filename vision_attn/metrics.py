"""Caption metrics the COCO way (pycocoevalcap: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D; no SPICE, which needs a CoreNLP
download; without Java no METEOR or PTB tokenizer), and whether attention points at the object a word names
(``docs/formats/metrics.md``)."""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from vision_attn.data.object_words import ObjectWords, built_in
from vision_attn.data.vocabulary import tokenize

log = logging.getLogger(__name__)

SAMPLES_PER_CELL = 16  # each cell's share inside a union of boxes is read at 16 x 16 points
_warned: set[str] = set()
_meteor: Any = None  # one METEOR scorer (a Java process) for the whole process: each start loads its tables
_meteor_pid = 0
_inherited: list[Any] = []  # a forked child keeps its parent's scorer referenced: collecting it would kill its Java


def meteor_scorer() -> Any:
    """pycocoevalcap's METEOR scorer, one per process (Java's start-up is paid once); a new one when its Java process
    has ended, or in a forked child (which shares its pipes)."""
    global _meteor, _meteor_pid
    if _meteor is not None and _meteor_pid != os.getpid():
        _inherited.append(_meteor)
        _meteor = None
    if _meteor is None or _meteor.meteor_p.poll() is not None:
        from pycocoevalcap.meteor.meteor import Meteor
        _meteor, _meteor_pid = Meteor(), os.getpid()
    return _meteor


def meteor_score(gts: Mapping[Any, list[str]], res: Mapping[Any, list[str]]) -> float:
    """METEOR of tokenized ``res`` against ``gts``. A failed Java process is one line; the scorer is dropped, its
    process ended and its lock freed (pycocoevalcap holds it past an error: the next use would wait forever)."""
    global _meteor
    scorer = meteor_scorer()
    try:
        return float(scorer.compute_score(gts, res)[0])
    except (ValueError, OSError) as error:
        _meteor = None
        scorer.meteor_p.kill()
        if scorer.lock.locked():
            scorer.lock.release()
        raise ValueError(f"METEOR's Java process failed ({' '.join(str(error).split())[:120]}); check that "
                         "`java -Xmx2G -version` runs here") from None


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def java_available() -> bool:
    """Whether ``java`` is on the PATH: METEOR and the PTB tokenizer of pycocoevalcap need it."""
    return shutil.which("java") is not None


def deduplicate(results: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One result per image id, the first seen: DDP samplers pad ranks with repeated images."""
    seen: dict[Any, dict[str, Any]] = {}
    for result in results:
        seen.setdefault(result["image_id"], dict(result))
    return list(seen.values())


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
        # one tokenizer run (one Java start) for references and candidates: it tokenizes line by line
        sides = (("ref", gts), ("res", res))
        tokenized = PTBTokenizer().tokenize({(side, key): [{"caption": c} for c in values]
                                             for side, captions in sides for key, values in captions.items()})
        gts, res = ({key: tokenized[side, key] for key in captions if (side, key) in tokenized}
                    for side, captions in sides)
    else:
        _warn_once("java", "Java not found: METEOR and the PTB tokenizer are skipped; the other metrics use "
                           "vision-attn's tokenizer (apt-get install default-jre-headless to get them)")
        gts, res = ({key: [" ".join(tokenize(c)) for c in values] for key, values in captions.items()}
                    for captions in (gts, res))
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores = {f"BLEU-{n}": float(value) for n, value in enumerate(bleu, start=1)}
    if use_java:
        scores["METEOR"] = meteor_score(gts, res)
    scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr-D"] = float(Cider().compute_score(gts, res)[0])
    return scores


def word_order_rates(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``unfinished_caption_rate``: the share of captions that say nothing, or end on a word the records' references
    use but never last ("... a red coat and", "... next"), a word that needs another after it. The references
    show which words those are, so no word list is needed; a word they never use is given the benefit of the doubt.
    ``unseen_pair_rate``: the share of captions in which two adjacent words, both used by the references, are
    side by side in none of them ("and a with a its own" on the scenes; on COCO a new but sound pair counts too)."""
    used, last, pairs = set(), set(), set()
    for record in records:
        for reference in record["references"]:
            words = tokenize(reference)
            used.update(words)
            last.update(words[-1:])
            pairs.update(zip(words, words[1:], strict=False))
    unfinished = unseen = 0
    for record in records:
        words = tokenize(record["caption"])
        unfinished += not words or (words[-1] in used and words[-1] not in last)
        unseen += any(pair not in pairs and {*pair} <= used for pair in zip(words, words[1:], strict=False))
    count = len(records) or float("nan")
    return {"unfinished_caption_rate": unfinished / count, "unseen_pair_rate": unseen / count}


class CiderD:
    """CIDEr-D (Vedantam et al. 2015) of single candidates, as a training reward: pycocoevalcap's ``Cider`` (tf-idf
    n-grams, n = 1..4, clipped at the reference's, Gaussian length penalty σ = 6, times 10) with the document
    frequencies taken once from ``corpus`` (every image's references). Tokens are any hashables."""

    n, sigma = 4, 6.0  # n-grams up to 4 words; the length penalty's σ

    def __init__(self, corpus: Iterable[Sequence[Sequence[Hashable]]]) -> None:
        document_frequency: Counter[tuple] = Counter()
        images = 0
        for references in corpus:
            images += 1
            document_frequency.update({gram for caption in references for gram in self._counts(caption)})
        if images == 0:
            raise ValueError("CIDEr-D needs a corpus of references for its document frequencies; it is empty")
        self.log_images = math.log(images)
        self.log_frequency = {gram: math.log(count) for gram, count in document_frequency.items()}

    def _counts(self, caption: Sequence[Hashable]) -> Counter[tuple]:
        caption = tuple(caption)
        return Counter(caption[i:i + k] for k in range(1, self.n + 1) for i in range(len(caption) - k + 1))

    def _vector(self, caption: Sequence[Hashable]) -> tuple[dict[tuple, float], list[float], int]:
        # tf-idf weight per n-gram, the norm per n, the length CIDEr-D compares (bigrams)
        weights, norms = {}, [0.0] * self.n
        log_frequency, log_images = self.log_frequency, self.log_images
        for gram, count in self._counts(caption).items():
            weight = count * (log_images - log_frequency.get(gram, 0.0))  # tf · log(N / df); df ≥ 1
            weights[gram] = weight
            norms[len(gram) - 1] += weight * weight
        return weights, [math.sqrt(v) for v in norms], max(len(caption) - 1, 0)

    def __call__(self, candidates: Sequence[Sequence[Hashable]],
                 references: Sequence[Sequence[Sequence[Hashable]]]) -> list[float]:
        """One score per candidate against ``references[i]`` (a list object shared by candidates is read once)."""
        if len(candidates) != len(references):
            raise ValueError(f"{len(candidates)} candidates but {len(references)} reference lists")
        cache: dict[int, list] = {}
        scores = []
        for candidate, refs in zip(candidates, references, strict=True):
            if id(refs) not in cache:
                cache[id(refs)] = [self._vector(r) for r in refs]
            weights, norms, length = self._vector(candidate)
            total = 0.0
            for ref_weights, ref_norms, ref_length in cache[id(refs)]:
                similarity = [0.0] * self.n
                for gram, weight in weights.items():
                    ref_weight = ref_weights.get(gram)
                    if ref_weight is not None:
                        similarity[len(gram) - 1] += min(weight, ref_weight) * ref_weight
                penalty = math.exp(-((length - ref_length) ** 2) / (2 * self.sigma ** 2))
                for k in range(self.n):
                    if norms[k] and ref_norms[k]:
                        similarity[k] /= norms[k] * ref_norms[k]
                total += sum(similarity) * penalty
            scores.append(10.0 * total / (self.n * max(len(refs), 1)))
        return scores


def pointed_box(alpha: Tensor, grid: Sequence[int], image_size: Sequence[int],
                boxes: Sequence[Sequence[float]]) -> int | None:
    """The box (x0, y0, x1, y1), grown by half a cell, that holds the centre of α's argmax cell (α over a Gh×Gw grid
    on an (H, W) image): its index, the nearest of several, or None."""
    cell_h, cell_w = image_size[0] / grid[0], image_size[1] / grid[1]
    row, col = divmod(int(alpha.argmax()), grid[1])
    x, y = (col + 0.5) * cell_w, (row + 0.5) * cell_h
    best, nearest = None, math.inf
    for index, (x0, y0, x1, y1) in enumerate(boxes):
        if x0 - cell_w / 2 <= x <= x1 + cell_w / 2 and y0 - cell_h / 2 <= y <= y1 + cell_h / 2:
            distance = math.hypot(max(x0 - x, 0, x - x1), max(y0 - y, 0, y - y1))
            if distance < nearest:
                best, nearest = index, distance
    return best


def box_coverage(boxes: Sequence[tuple[float, float, float, float]], grid: tuple[int, int],
                 size: tuple[float, float]) -> Tensor:
    """Each cell's share (Gh, Gw) inside the boxes on a grid over an (H, W) image: exact for one box, for several
    their union read at ``SAMPLES_PER_CELL``² points a cell."""
    (grid_h, grid_w), (height, width) = grid, size
    cell_h, cell_w = height / grid_h, width / grid_w
    if len(boxes) == 1:
        x0, y0, x1, y1 = boxes[0]
        lefts = torch.arange(grid_w, dtype=torch.float64) * cell_w
        tops = torch.arange(grid_h, dtype=torch.float64) * cell_h
        overlap_x = ((lefts + cell_w).clamp(max=x1) - lefts.clamp(min=x0)).clamp(min=0) / cell_w  # (Gw,)
        overlap_y = ((tops + cell_h).clamp(max=y1) - tops.clamp(min=y0)).clamp(min=0) / cell_h  # (Gh,)
        return overlap_y[:, None] * overlap_x[None, :]
    steps = (torch.arange(SAMPLES_PER_CELL, dtype=torch.float64) + 0.5) / SAMPLES_PER_CELL
    xs = ((torch.arange(grid_w, dtype=torch.float64)[:, None] + steps) * cell_w).flatten()  # (Gw·S,)
    ys = ((torch.arange(grid_h, dtype=torch.float64)[:, None] + steps) * cell_h).flatten()  # (Gh·S,)
    inside = torch.zeros(len(ys), len(xs), dtype=torch.bool)
    for x0, y0, x1, y1 in boxes:
        inside |= ((ys >= y0) & (ys <= y1))[:, None] & ((xs >= x0) & (xs <= x1))[None, :]
    return inside.double().view(grid_h, SAMPLES_PER_CELL, grid_w, SAMPLES_PER_CELL).mean(dim=(1, 3))


def pointing_scores(records: Iterable[Mapping[str, Any]], boxes: Mapping[Any, Sequence[tuple[str, Sequence[float]]]],
                    *, box_scale: Mapping[Any, tuple[float, float]] | None = None, words: ObjectWords | None = None,
                    masks: Callable[[Any, str], Tensor | None] | None = None) -> dict[str, float]:
    """Pointing accuracy (``pointed_box`` on the named category's boxes) and mean α mass in them, over each object a
    caption names (``words``, default the scenes') that the image holds. ``boxes``: image id -> (category, [x, y,
    w, h]) in input pixels, or file pixels with ``box_scale`` (sx, sy). ``masks(image_id, category)`` (H, W) adds
    the α mass in the mask; ``object_named_twice_rate``: captions where two mentions' α peak on one object."""
    words = words or built_in("scenes")
    hits, masses, counted, mask_masses, masked = 0, 0.0, 0, 0.0, 0
    captions = twice = 0
    for record in records:
        scale_x, scale_y = (box_scale or {}).get(record["image_id"], (1.0, 1.0))
        objects: dict[str, list[tuple[float, float, float, float]]] = {}  # category -> its boxes, x0 y0 x1 y1
        for entry in boxes.get(record["image_id"], []):  # (category, [x, y, w, h], ...)
            x, y, w, h = entry[1]
            objects.setdefault(entry[0], []).append((x * scale_x, y * scale_y, (x + w) * scale_x, (y + h) * scale_y))
        every_box = [box for rectangles in objects.values() for box in rectangles]
        grid, size = tuple(record["grid"]), tuple(record["image_size"])
        alphas = torch.as_tensor(record["alphas"], dtype=torch.float64).view(-1, *grid)  # (T, L) -> (T, Gh, Gw)
        mentions = words.mentions(record["tokens"])
        pointed = [pointed_box(alphas[t], grid, size, every_box) for t, _ in mentions]  # each mention's peak object
        held = [index for index in pointed if index is not None]
        captions, twice = captions + 1, twice + (len(held) > len(set(held)))
        for t, category in mentions:
            if category not in objects:
                continue
            rectangles, alpha = objects[category], alphas[t]
            hits += pointed_box(alpha, grid, size, rectangles) is not None
            # α mass in the boxes: each cell's α spread evenly over the cell, times the cell's share inside them
            masses += float((alpha * box_coverage(rectangles, grid, size)).sum())
            counted += 1
            mask = masks(record["image_id"], category) if masks is not None else None
            if mask is not None:
                coverage = torch.nn.functional.adaptive_avg_pool2d(mask.double()[None, None], grid)[0, 0]
                mask_masses += float((alpha * coverage).sum())
                masked += 1
    nan = float("nan")
    scores = {"pointing_accuracy": hits / counted if counted else nan,
              "alpha_mass_in_box": masses / counted if counted else nan, "pointing_words": float(counted),
              "object_named_twice_rate": twice / captions if captions else nan}
    if masks is not None and counted:
        scores["alpha_mass_in_mask"] = mask_masses / masked if masked else nan
    return scores


def pointing_by_mention(records: Iterable[Mapping[str, Any]],
                        boxes: Mapping[Any, Sequence[tuple[str, Sequence[float]]]],
                        words: ObjectWords | None = None) -> dict[tuple[int, int], dict[str, float]]:
    """``pointing_scores`` split by (objects in the scene, n-th object a caption names)."""
    words = words or built_in("scenes")
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for record in records:
        objects = len(boxes.get(record["image_id"], []))
        for mention, (t, _) in enumerate(words.mentions(record["tokens"]), start=1):
            only_this = [word if i == t else "" for i, word in enumerate(record["tokens"])]
            groups.setdefault((objects, mention), []).append({**record, "tokens": only_this})
    return {key: pointing_scores(groups[key], boxes, words=words) for key in sorted(groups)}


def hallucination_scores(records: Iterable[Mapping[str, Any]], present: Mapping[Any, set[str]],
                         words: ObjectWords) -> dict[str, float]:
    """CHAIR (Rohrbach et al. 2018): the share of mentions (CHAIRi) and of captions (CHAIRs) naming absent objects."""
    mentions = hallucinated = captions = bad_captions = 0
    for record in records:
        found = [category for _, category in words.mentions(record["tokens"])]
        wrong = sum(category not in present.get(record["image_id"], set()) for category in found)
        mentions, hallucinated = mentions + len(found), hallucinated + wrong
        captions, bad_captions = captions + 1, bad_captions + (wrong > 0)
    return {"CHAIRi": hallucinated / mentions if mentions else float("nan"),
            "CHAIRs": bad_captions / captions if captions else float("nan"), "object_mentions": float(mentions)}


def mask_mass(weights: Tensor, masks: Tensor) -> Tensor:
    """The share of a ViT map's mass (B, Gh, Gw) on the object's pixels ``masks`` (B, H, W, multiples of the grid),
    each cell weighed by its share of mask pixels: a map blind to the object scores the mask's area share."""
    if masks.shape[-2] % weights.shape[-2] or masks.shape[-1] % weights.shape[-1]:
        raise ValueError(f"a {tuple(masks.shape[-2:])} mask does not tile a {tuple(weights.shape[-2:])} grid")
    coverage = torch.nn.functional.adaptive_avg_pool2d(masks.float()[:, None], weights.shape[-2:])[:, 0]
    weights = weights.clamp(min=0)
    weights = weights / weights.sum(dim=(-2, -1), keepdim=True).clamp_min(1e-12)
    return (weights * coverage).sum(dim=(-2, -1))


def pointing_game(weights: Tensor, masks: Tensor) -> Tensor:
    """The pointing game (Zhang et al. 2016): does the mask hold the centre pixel of the map's argmax cell?"""
    if masks.shape[-2] % weights.shape[-2] or masks.shape[-1] % weights.shape[-1]:
        raise ValueError(f"a {tuple(masks.shape[-2:])} mask does not tile a {tuple(weights.shape[-2:])} grid")
    cells = weights.shape[-2:]
    cell_h, cell_w = masks.shape[-2] // cells[0], masks.shape[-1] // cells[1]
    peak = weights.flatten(1).argmax(dim=1)
    rows, cols = peak // cells[1] * cell_h + cell_h // 2, peak % cells[1] * cell_w + cell_w // 2
    return masks[torch.arange(len(masks), device=masks.device), rows, cols].bool()


def scene_scores(records: Iterable[Mapping[str, Any]], scenes: Mapping[Any, Sequence[tuple[str, str | None]]],
                 words: ObjectWords | None = None) -> dict[str, float]:
    """The scene metrics over the objects the captions name; ``scenes``: image id -> [(category, colour or None)]."""
    words = words or built_in("scenes")
    objects = emitted = named_right = coloured = colour_right = repeated = captions = recalled = 0
    for record in records:
        scene = list(scenes.get(record["image_id"], []))
        tokens = list(record["tokens"])
        in_scene = Counter(name for name, _ in scene)
        colours = {name: colour for name, colour in scene}
        named = words.mentions(tokens)
        said = Counter(category for _, category in named)
        captions += 1
        objects += len(scene)
        recalled += sum(1 for name, _ in scene if said[name])
        emitted += sum(said.values())
        repeated += any(count > 1 and in_scene[word] == 1 for word, count in said.items())
        for t, category in named:
            if in_scene[category]:
                named_right += 1
                if colours[category] is not None:
                    coloured += 1
                    colour_right += t > 0 and tokens[t - 1] == colours[category]
    nan = float("nan")
    return {"object_recall": recalled / objects if objects else nan,
            "object_precision": named_right / emitted if emitted else nan,
            "colour_accuracy": colour_right / coloured if coloured else nan,
            "repeated_object_rate": repeated / captions if captions else nan}
