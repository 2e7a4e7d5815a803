"""The results JSON of captioning (SPEC §4): one home for its record format, written and read.

A record is the COCO results entry ``{"image_id", "caption"}`` plus where the words looked: ``file_name``,
``tokens`` (the emitted words), ``grid`` [Gh, Gw], ``image_size`` [H, W] of the network input, ``alphas``
(one row of L = Gh·Gw weights per token) and ``betas`` (one per token). Without the extra keys the list is
exactly what pycocoevalcap and ``COCO.loadRes`` read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from vision_attn.io import write_json_atomically

RECORD_KEYS = ("image_id", "file_name", "caption", "tokens", "grid", "image_size", "alphas", "betas")


def caption_record(image_id: Any, words: Sequence[str], alphas: Tensor, betas: Tensor, *, grid: tuple[int, int],
                   image_size: tuple[int, int], file_name: str = "") -> dict[str, Any]:
    """A SPEC §4 record for one caption: ``alphas`` (T, L) and ``betas`` (T,) are those of its T words."""
    return {
        "image_id": image_id,
        "file_name": file_name,
        "caption": " ".join(words),
        "tokens": list(words),
        "grid": list(grid),
        "image_size": list(image_size),
        "alphas": [[round(float(a), 6) for a in row] for row in alphas.tolist()],
        "betas": [round(float(b), 6) for b in betas.tolist()],
    }


def write_results(path: str | os.PathLike, records: Sequence[dict[str, Any]]) -> Path:
    """Write records atomically, keeping only the SPEC §4 keys (evaluation adds references and objects)."""
    return write_json_atomically(path, [{k: v for k, v in record.items() if k in RECORD_KEYS} for record in records])


def read_results(path: str | os.PathLike) -> list[tuple[dict[str, Any], Path]]:
    """The records of a results JSON with the image file each names, found in the working directory or beside
    the JSON. A missing file, invalid JSON, a list of anything but records, or a missing image is a one-line
    error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results JSON")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(loaded, list) or not all(isinstance(record, dict) for record in loaded):
        raise ValueError(f"{path}: expected a list of caption records (SPEC §4), as `caption` writes")
    found = []
    for record in loaded:
        name = str(record.get("file_name") or "")
        image = Path(name) if Path(name).is_file() else path.parent / name
        if not name or not image.is_file():
            raise FileNotFoundError(f"{path}: image {name!r} of record {record.get('image_id')!r} not found "
                                    f"(looked in the working directory and in {path.parent})")
        found.append((record, image))
    return found
