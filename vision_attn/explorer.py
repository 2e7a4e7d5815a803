"""The attention explorer, as ``vision-attn explore`` writes it: a static site drawing each word's α (captioner) or
each ViT map (rollout, every layer, the last layer's heads) in the browser from the attention arrays.

    site/index.html       thumbnails, a search box on the captions' words, the scene metrics per image
    site/view.html        one image: ``view.html?n=<k>``
    site/explorer.js|css  the viewer (no network, no CDN: it works from file:// and from any static server)
    site/data/index.js    the index's entries
    site/data/items/k.js  image k's attention arrays, loaded when its page opens
    site/data/colours.js  the colour map's 256 RGB entries, the same as ``overlay.colorize``'s
    site/images/k.png     the image as shown, site/thumbs/k.jpg its thumbnail

Data files are JavaScript handing JSON to the page (``VA.item({...})``): browsers refuse ``fetch`` of ``file://``.
``<`` is escaped, so no caption can close a script; the page puts words and class names in only as text.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.evaluation import caption_files
from vision_attn.checkpoint import CAPTIONER, KIND_NAMES, VIT, checkpoint_kind, load_file
from vision_attn.data.coco import SceneObject, read_objects
from vision_attn.data.images import BadImageCounter, OnBadImage, expand_inputs, open_image, readable_batches
from vision_attn.errors import CheckpointError
from vision_attn.io import OwnedFolder, input_file
from vision_attn.metrics import pointing_scores, scene_scores
from vision_attn.overlay import _colour_table
from vision_attn.results import read_results
from vision_attn.vit.classifier import Classifier, centre_square, ranked

ASSETS = Path(__file__).with_name("explorer_assets")
VIEW_SIZE, THUMB_SIZE = 448, 112


def js_data(callback: str, payload: Any) -> str:
    """``VA.<callback>(<JSON>);``, ``<``, U+2028 and U+2029 escaped so that no text can end or break the script."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return f"VA.{callback}({text});\n"


def _save_views(image: Image.Image, folder: Path, number: int) -> tuple[str, str, tuple[int, int]]:
    # save the image as shown (longer side at most VIEW_SIZE) and its thumbnail; their paths and the size
    shown = image.convert("RGB")
    if max(shown.size) > VIEW_SIZE:
        shown.thumbnail((VIEW_SIZE, VIEW_SIZE), Image.Resampling.LANCZOS)
    shown.save(folder / "images" / f"{number}.png")
    thumb = shown.copy()
    thumb.thumbnail((THUMB_SIZE, THUMB_SIZE))
    thumb.save(folder / "thumbs" / f"{number}.jpg", quality=85)
    return f"images/{number}.png", f"thumbs/{number}.jpg", shown.size


def _scene_metrics(record: dict[str, Any], objects: Sequence[Any] | None, image: Image.Image) -> dict[str, float]:
    # the scene metrics of one caption record against its objects (SceneObject), whose boxes are in the file's pixels
    if objects is None:
        return {}
    image_id, size = record["image_id"], record.get("image_size")
    scores = scene_scores([record], {image_id: [(o.name, o.colour) for o in objects]})
    scale = {image_id: (size[1] / image.width, size[0] / image.height)} if size else None  # to α's input pixels
    scores.update(pointing_scores([record], {image_id: objects}, box_scale=scale))
    keep = ("object_recall", "object_precision", "colour_accuracy", "repeated_object_rate", "pointing_accuracy")
    return {name: round(scores[name], 4) for name in keep if name in scores and not math.isnan(scores[name])}


def caption_entries(pairs: Sequence[tuple[dict[str, Any], Path]], folder: Path, *,
                    objects: dict[Any, list[SceneObject]] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Write each captioner record's data and images into ``folder``; the index entries (with ``objects``' metrics)."""
    index = []
    for number, (record, path) in enumerate(pairs):
        image = open_image(path, mode="RGB")
        shown, thumb, size = _save_views(image, folder, number)
        found = None if objects is None else objects.get(record["image_id"], [])
        metrics = _scene_metrics(record, found, image)
        item = {"kind": "captioner", "id": record["image_id"], "file": Path(record["file_name"]).name,
                "image": shown, "size": size, "caption": record["caption"], "tokens": record["tokens"],
                "grid": record["grid"], "alphas": record["alphas"], "betas": record.get("betas"),
                "head_alphas": record.get("head_alphas"), "beams": record.get("beams"), "metrics": metrics,
                "objects": None if found is None else [{"name": o.name, "colour": o.colour} for o in found]}
        (folder / "data" / "items" / f"{number}.js").write_text(js_data("item", item), encoding="utf-8")
        index.append({"n": number, "id": record["image_id"], "file": item["file"], "thumb": thumb,
                      "text": record["caption"], "metrics": metrics})
        if progress:
            progress(number + 1, len(pairs))
    return index


@torch.inference_mode()
def vit_entries(classifier: Classifier, inputs: Sequence[tuple[Any, Path]], folder: Path, *,
                on_bad_image: OnBadImage = "error", bad_images: BadImageCounter | None = None,
                progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Write each image's ViT data (top-5 classes, every layer's attention per head) into ``folder``; the index."""
    model = classifier.model
    index: list[dict[str, Any]] = []
    for chunk, batch in readable_batches(inputs, lambda item: classifier.preprocess(item[1]), batch_size=16,
                                         on_bad_image=on_bad_image, bad_images=bad_images):
        logits, attentions = model.forward_with_attention(batch.to(classifier.device))
        for row, (image_id, path) in enumerate(chunk):
            number = len(index)
            shown, thumb, size = _save_views(open_image(path, mode="RGB"), folder, number)
            top = [[name, round(p, 5)] for name, p in ranked(classifier, logits[row], 5)]
            item = {"kind": "vit", "id": image_id, "file": path.name, "image": shown, "size": size,
                    "box": list(centre_square(size)), "grid": list(model.grid_size),
                    "prefix": model.num_prefix_tokens, "pool": model.global_pool, "top": top,
                    "tokens": attentions[0].shape[-1],
                    # layer l, head h: the (N, N) attention, row-major (N = prefix tokens + patches)
                    "attention": [[[round(float(v), 5) for v in a[row, h].flatten().tolist()]
                                   for h in range(a.shape[1])] for a in attentions]}
            (folder / "data" / "items" / f"{number}.js").write_text(js_data("item", item), encoding="utf-8")
            index.append({"n": number, "id": image_id, "file": path.name, "thumb": thumb,
                          "text": " ".join(f"{name} {p:.1%}" for name, p in top[:1]), "metrics": {}})
            if progress:
                progress(number + 1, len(inputs))
    return index


def site_folder(out: str | os.PathLike, inputs: Sequence[Path], *, overwrite: bool = False) -> OwnedFolder:
    """The site's folder, checked before any work: not holding an input, nor (unless ``overwrite``) others' files."""
    resolved = Path(out).resolve()
    for path in inputs:
        if resolved in Path(path).resolve().parents:
            raise ValueError(f"{out}: holds the input {path}; write the site to another folder")
    return OwnedFolder(out, "explore", overwrite=overwrite, inputs=inputs)


def write_site(owner: OwnedFolder, title: str, build: Callable[[Path], list[dict[str, Any]]]) -> Path:
    """Build a site with ``build`` (which returns the index entries) and put it in place; a failure changes nothing."""
    with owner.staged() as staging:
        for sub in ("data/items", "images", "thumbs"):
            (staging / sub).mkdir(parents=True)
        entries = build(staging)
        if not entries:
            raise ValueError("no image to show: every input was skipped")
        (staging / "data" / "index.js").write_text(js_data("index", {"title": title, "entries": entries}),
                                                   encoding="utf-8")
        (staging / "data" / "colours.js").write_text(js_data("colours", _colour_table("turbo").tolist()),
                                                     encoding="utf-8")
        for asset in ("index.html", "view.html", "explorer.js", "explorer.css"):
            shutil.copyfile(ASSETS / asset, staging / asset)
    return owner.path


def _show_progress(done: int, total: int) -> None:
    if done == total or done % 50 == 0:
        print(f"\rimages: {done}/{total}", end="\n" if done == total else "", flush=True)


def explore(*, results: str | os.PathLike | None, images: Sequence[str | os.PathLike], out: str | os.PathLike,
            checkpoint: str | os.PathLike | None = None, instances: str | os.PathLike | None = None,
            attributes: str | os.PathLike | None = None, beam_size: int | None = None, device: str = "cpu",
            on_bad_image: OnBadImage = "error", quiet: bool = False, overwrite: bool = False) -> tuple[Path, int]:
    """``vision-attn explore``: the site for a results JSON (its images in the folder ``images`` if given), or for
    ``images`` run through a checkpoint (a captioner with every beam, or a ViT); the site and its image count."""
    progress = None if quiet else _show_progress
    for path in filter(None, (instances, attributes)):
        input_file(path, "an instances or attributes JSON")
    # read and checked before any work: a bad instances or attributes file is one line, not a half-made site
    objects = read_objects(Path(instances), Path(attributes) if attributes else None) if instances else None
    if checkpoint is None:
        if results is None:
            raise ValueError("give a results JSON (from `vision-attn caption`), or --ckpt with --images")
        folder = Path(images[0]) if images else None
        if folder is not None and not folder.is_dir():
            raise ValueError(f"{folder}: not a folder of images")
        pairs = read_results(results, image_dir=folder)
        owner = site_folder(out, [Path(results), *(p for _, p in pairs)], overwrite=overwrite)
    else:
        loaded = load_file(checkpoint)
        kind = checkpoint_kind(loaded)
        inputs = expand_inputs(images)
        if not inputs:
            raise ValueError("--ckpt needs --images: image files or folders to run it on")
        if results is not None:
            raise ValueError("give a results JSON or --ckpt, not both")
        owner = site_folder(out, [Path(checkpoint), *(p for _, p in inputs)], overwrite=overwrite)
        if kind == VIT:
            classifier = Classifier.from_checkpoint(checkpoint, device=device, loaded=loaded)
            bad = BadImageCounter()
            built = write_site(owner, Path(checkpoint).name, lambda site: vit_entries(
                classifier, inputs, site, on_bad_image=on_bad_image, bad_images=bad, progress=progress))
            return built, len(inputs) - bad.take()
        if kind != CAPTIONER:
            raise CheckpointError(f"{checkpoint}: not a checkpoint of {' or '.join(KIND_NAMES.values())}")
        captioner = Captioner.from_checkpoint(checkpoint, device=device, loaded=loaded)
        pairs = [(record, Path(record["file_name"])) for record in caption_files(
            captioner, inputs, beam_size=beam_size, on_bad_image=on_bad_image, all_beams=True)]
    return write_site(owner, Path(results or checkpoint).name, lambda site: caption_entries(
        pairs, site, objects=objects, progress=progress)), len(pairs)
