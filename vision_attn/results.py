"""The results JSON of captioning (``docs/formats/results.md``), written and read: COCO's ``{"image_id", "caption"}``
plus ``file_name``, ``tokens``, ``grid`` [Gh, Gw], the input's ``image_size`` [H, W], ``alphas`` (a row of Gh·Gw
weights per token) and ``betas`` (one per token)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from vision_attn.data.formats import MAX_CAPTION_WORDS, MAX_ID, caption_problem, read_json
from vision_attn.io import write_json_atomically

RECORD_KEYS = ("image_id", "file_name", "caption", "tokens", "grid", "image_size", "alphas", "betas")
OPTIONAL_KEYS = ("head_alphas", "beams")  # a multihead score's per-head α; every beam (`caption --all-beams`)
MAX_NAME = 4096  # characters of an image id or file name given as a string: a path's length (PATH_MAX)
MAX_RESULTS_WORDS = 10_000_000  # the words of all of a file's captions: a large split's images at a generous length


def caption_record(image_id: Any, words: Sequence[str], alphas: Tensor, betas: Tensor, *, grid: tuple[int, int],
                   image_size: tuple[int, int], file_name: str = "", head_alphas: Tensor | None = None
                   ) -> dict[str, Any]:
    """A results record for one caption of T words: ``alphas`` (T, L), ``betas`` (T,), a multihead score's
    ``head_alphas`` (T, K, L). A non-finite α or β is refused naming the image (JSON has no NaN)."""
    for name, values in (("α", alphas), ("β", betas), ("α", head_alphas)):
        if values is not None and not bool(values.isfinite().all()):
            raise FloatingPointError(f"{file_name or image_id}: the captioner's {name} is NaN or infinite for this "
                                     "image; its weights or this input make it overflow")
    record = {"image_id": image_id, "file_name": file_name, "caption": " ".join(words), "tokens": list(words),
              "grid": list(grid), "image_size": list(image_size),
              "alphas": [[round(float(a), 6) for a in row] for row in alphas.tolist()],
              "betas": [round(float(b), 6) for b in betas.tolist()]}
    if head_alphas is not None:
        record["head_alphas"] = [[[round(float(a), 6) for a in row] for row in word] for word in head_alphas.tolist()]
    return record


def write_results(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> Path:
    """Write records atomically, with only their ``RECORD_KEYS`` and ``OPTIONAL_KEYS`` (evaluation adds others)."""
    keep = RECORD_KEYS + OPTIONAL_KEYS
    return write_json_atomically(path, [{k: v for k, v in record.items() if k in keep} for record in records])


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _weights(row: Any, count: int) -> bool:
    return isinstance(row, list) and len(row) == count and all(_is_number(value) and value >= 0 for value in row)


def record_problem(record: Any) -> str | None:
    """What is wrong with a results record with attention (``docs/formats/results.schema.json``), or None."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not a record"
    image_id, name, caption = record.get("image_id"), record.get("file_name"), record.get("caption")
    if problem := id_problem(image_id):
        return problem
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        return f"file_name must be a non-empty string of at most {MAX_NAME} characters, got {name!r:.60}"
    if not isinstance(caption, str):
        return f"caption must be a string, got {caption!r:.60}"
    if problem := caption_problem(caption):
        return problem
    tokens, grid, alphas, betas = (record.get(key) for key in ("tokens", "grid", "alphas", "betas"))
    if not isinstance(tokens, list) or not all(isinstance(token, str) for token in tokens):
        return "tokens must be a list of strings (write the file with `vision-attn caption`)"
    if len(tokens) > MAX_CAPTION_WORDS or sum(map(len, tokens)) > len(caption):
        return (f"tokens must be the caption's words, at most {MAX_CAPTION_WORDS}, got {len(tokens)} tokens of "
                f"{sum(map(len, tokens))} characters for a caption of {len(caption)}")
    for key in ("grid", "image_size"):
        value = record.get(key)
        if (key == "grid" or value is not None) and not (isinstance(value, list) and len(value) == 2
                                                         and all(map(_is_count, value))):
            return f"{key} must be two positive whole numbers, got {value!r}"
    if not isinstance(alphas, list) or len(alphas) != len(tokens):
        return f"alphas must hold one row per token ({len(tokens)}), got {alphas!r:.60}"
    cells = grid[0] * grid[1]
    for t, row in enumerate(alphas):
        if not _weights(row, cells):
            return f"alphas row {t} must hold {cells} finite weights >= 0 (a {grid[0]}x{grid[1]} grid)"
    if betas is not None and not _weights(betas, len(tokens)):
        return f"betas must hold one finite number >= 0 per token ({len(tokens)})"
    heads = record.get("head_alphas")
    if heads is not None:
        if not isinstance(heads, list) or len(heads) != len(tokens) or not all(
                isinstance(word, list) and word and len(word) == len(heads[0]) for word in heads):
            return f"head_alphas must hold one list of K α rows per token ({len(tokens)})"
        if not all(_weights(row, cells) for word in heads for row in word):
            return f"head_alphas rows must hold {cells} finite weights >= 0 (a {grid[0]}x{grid[1]} grid)"
    beams = record.get("beams")
    if beams is not None:
        if not isinstance(beams, list) or not beams:
            return "beams must be a non-empty list of the search's captions"
        for n, beam in enumerate(beams):
            problem = None if isinstance(beam, dict) else "is not a record"
            problem = problem or record_problem({**beam, "image_id": image_id, "file_name": name, "grid": grid,
                                                 "image_size": record.get("image_size"), "beams": None})
            problem = problem or next((f"{key} must be a finite number, got {beam[key]!r}" for key in
                                       ("log_prob", "score") if key in beam and not _is_number(beam[key])), None)
            if problem:
                return f"beam {n} {problem}"
    return None


def id_problem(image_id: Any) -> str | None:
    """What is wrong with a record's ``image_id`` (a 64-bit whole number, or at most ``MAX_NAME`` characters)."""
    if isinstance(image_id, bool) or not isinstance(image_id, int | str):
        return f"image_id must be a number or a string, got {image_id!r:.60}"
    if isinstance(image_id, int) and not -MAX_ID <= image_id <= MAX_ID:
        return f"image_id must be a 64-bit whole number, got one of {len(str(abs(image_id)))} digits"
    if isinstance(image_id, str) and len(image_id) > MAX_NAME:
        return f"image_id must be at most {MAX_NAME} characters, got {len(image_id)}"
    return None


def check_total_words(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Refuse a results file whose captions hold more than ``MAX_RESULTS_WORDS`` words together."""
    total = sum(len(record["caption"].split()) for record in records)
    if total > MAX_RESULTS_WORDS:
        raise ValueError(f"{path}: its captions hold {total} words, more than the {MAX_RESULTS_WORDS} a results file "
                         "may (scoring time grows with them)")


def read_results(path: str | os.PathLike, *, image_dir: str | os.PathLike | None = None
                 ) -> list[tuple[dict[str, Any], Path]]:
    """A results JSON's records with their image files (in ``image_dir``, else here or beside the JSON)."""
    path = Path(path)
    loaded = read_json(path, "a results JSON")
    if not isinstance(loaded, list) or not all(isinstance(record, dict) for record in loaded):
        raise ValueError(f"{path}: expected a list of caption records, as `caption` writes")
    found = []
    for index, record in enumerate(loaded):
        if problem := record_problem(record):
            raise ValueError(f"{path}: record {index} ({record.get('file_name') or record.get('image_id')!r:.60}): "
                             f"{problem}")
        name = record["file_name"]
        if image_dir is not None:
            image = Path(image_dir) / name
            image = image if image.is_file() else Path(image_dir) / Path(name).name
            where = str(image_dir)
        else:
            image = Path(name) if Path(name).is_file() else path.parent / name
            where = f"the working directory and in {path.parent}"
        if not image.is_file():
            raise FileNotFoundError(f"{path}: image {name!r} of record {record.get('image_id')!r} not found "
                                    f"(looked in {where})")
        found.append((record, image))
    check_total_words(path, loaded)
    return found


ATTENTION_KEYS = ("tokens", "grid", "image_size", "alphas", "betas", "head_alphas", "beams")


def read_scored_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a COCO results JSON to score (ours or another tool's), one per image id, in order. Refused
    in one line: anything but records with a valid ``image_id`` and ``caption``, bad attention, two different
    captions of one image (the same one twice, as DDP's padding makes, is kept once)."""
    path = Path(path)
    loaded = read_json(path, "a results JSON")
    if not isinstance(loaded, list):
        raise ValueError(f'{path}: expected the COCO results format, a list of {{"image_id", "caption"}}, got a '
                         f"{type(loaded).__name__}")
    first: dict[Any, int] = {}
    records = []
    for index, record in enumerate(loaded):
        if not isinstance(record, dict):
            raise ValueError(f'{path}: record {index} is a {type(record).__name__}, not a {{"image_id", "caption"}} '
                             "record")
        image_id, caption = record.get("image_id"), record.get("caption")
        if problem := id_problem(image_id):
            raise ValueError(f"{path}: record {index}: {problem}")
        where = f"{path}: record {index} (image {image_id!r:.60})"
        if not isinstance(caption, str):
            raise ValueError(f"{where}: caption must be a string, got {caption!r:.60}")
        if problem := caption_problem(caption):
            raise ValueError(f"{where}: {problem}")
        if any(record.get(key) is not None for key in ATTENTION_KEYS):
            if problem := record_problem({**record, "file_name": "-"}):
                raise ValueError(f"{where}: {problem}")
        if image_id in first:
            earlier = loaded[first[image_id]]["caption"]
            if earlier != caption:
                shown = [repr(text if len(text) <= 40 else f"{text[:37]}...") for text in (earlier, caption)]
                raise ValueError(f"{path}: records {first[image_id]} and {index} both caption image {image_id!r:.60}, "
                                 f"differently ({shown[0]} and {shown[1]}); keep one record per image")
            continue
        first[image_id] = index
        records.append(dict(record))
    if not records:
        raise ValueError(f"{path}: holds no records to score")
    check_total_words(path, records)
    return records
