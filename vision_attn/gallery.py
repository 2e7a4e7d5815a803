"""Attention overlays as ``vision-attn overlay`` makes them, of results JSON or images through a checkpoint: one PNG
per image and an index.html."""

from __future__ import annotations

import argparse
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.evaluation import caption_files
from vision_attn.checkpoint import CAPTIONER, KIND_NAMES, VIT, checkpoint_kind, load_file
from vision_attn.cli_arguments import bounded_int, number_in
from vision_attn.data.images import BadImageCounter, OnBadImage, expand_inputs, load_or_skip, open_image
from vision_attn.errors import CheckpointError
from vision_attn.io import OwnedFolder, output_file
from vision_attn.overlay import caption_overlay, save_png, write_gallery
from vision_attn.results import read_results
from vision_attn.vit.classifier import Classifier
from vision_attn.vit.map_figures import vit_overlays
from vision_attn.vit.rollout import HeadFusion


def _option(default: Any, help: str, **argparse_settings: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_settings})


@dataclass
class OverlayOptions:
    """How the overlays are drawn and laid out; each field is a ``vision-attn overlay`` option."""

    upsample: str = _option("bilinear", "how the attention grid is enlarged to the image (default bilinear)",
                            choices=["bilinear", "pyramid"])
    sigma: float | None = _option(None, "Gaussian smoothing in output pixels (default: a quarter of a grid cell)",
                                  type=number_in(0.0, 512.0, why="a blur wider than a panel only flattens the map, "
                                                                  "and its kernel costs memory"))
    cmap: str = _option("turbo", "matplotlib colour map (default turbo)")
    opacity: float = _option(0.6, "blend opacity at the strongest attention (0 to 1)", type=number_in(0.0, 1.0))
    panel_size: int = _option(224, "longer side of each panel in pixels, 16 to 2048",
                              type=bounded_int(16, 2048, "a panel larger than a 4K screen's side only costs memory"))
    columns: int = _option(5, "panels per row before wrapping, 1 to 64 (default 5)",
                           type=bounded_int(1, 64, "a row of more panels is wider than any screen, and its "
                                                   "figure costs memory"))
    head_fusion: HeadFusion = _option("mean", "", shared=True)
    discard_ratio: float = _option(0.0, "", shared=True)
    gradient_class: str | None = _option(None, "ViT: also draw gradient rollout for this class (name or index)")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add the fields' options but the shared ones (``--head-fusion``, ``--discard-ratio``)."""
        for option in fields(cls):
            settings = {k: v for k, v in option.metadata.items() if k != "shared"}
            if not option.metadata.get("shared"):
                parser.add_argument(f"--{option.name.replace('_', '-')}", default=option.default, **settings)

    @classmethod
    def from_arguments(cls, namespace: argparse.Namespace) -> OverlayOptions:
        """The options from the parsed command line (the shared options included)."""
        return cls(**{option.name: getattr(namespace, option.name) for option in fields(cls)})

    @property
    def drawing(self) -> dict[str, Any]:
        """How a figure is drawn: each map's upsampling, smoothing, colour map and opacity; the panels' layout."""
        return {"mode": self.upsample, "sigma": self.sigma, "cmap": self.cmap, "opacity": self.opacity,
                "panel_size": self.panel_size, "columns": self.columns}


def _png_names(sources: Sequence[str]) -> dict[str, deque[str]]:
    # a PNG name per source, reserved before anything is drawn: <stem>.png, then _2, _3... when taken
    reserved: dict[str, deque[str]] = {}
    used: set[str] = set()
    for source in sources:
        stem = Path(source).stem or "image"
        name, counter = f"{stem}.png", 2
        while name in used:
            name, counter = f"{stem}_{counter}.png", counter + 1
        used.add(name)
        reserved.setdefault(source, deque()).append(name)
    return reserved


class OverlaysWritten(NamedTuple):
    """What ``draw_overlays`` wrote: the gallery page, the number of overlays, and the note on skipped images."""

    page: Path
    count: int
    skipped_note: str


def draw_overlays(inputs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
                  checkpoint: str | os.PathLike | None = None, options: OverlayOptions | None = None,
                  beam_size: int | None = None, batch_size: int = 32, on_bad_image: OnBadImage = "error",
                  device: str = "cpu", on_overlay: Callable[[str, str, Path], None] | None = None,
                  overwrite: bool = False) -> OverlaysWritten:
    """Overlays of results JSON, or images drawn with ``checkpoint``, into ``out`` with a gallery page."""
    options = options or OverlayOptions()
    json_inputs = [path for path in inputs if str(path).lower().endswith(".json")]
    images = [path for path in inputs if path not in json_inputs]
    records = [item for path in json_inputs for item in read_results(path)]
    expanded = expand_inputs(images)
    image_paths = [path for _, path in expanded]
    loaded = kind = None
    if images:
        if not checkpoint:
            raise ValueError("--ckpt is needed to overlay image files (only results JSON can go without)")
        loaded = load_file(checkpoint)
        kind = checkpoint_kind(loaded)
        if kind not in (VIT, CAPTIONER):
            what = f"a {KIND_NAMES[kind]} checkpoint has no attention to draw" if kind in KIND_NAMES \
                else "not a checkpoint written by `vision-attn fit` (no model kind)"
            raise CheckpointError(f"{checkpoint}: {what}")
    # the draw order: a ViT's images, then the records (results JSON first, then the captioner's images)
    sources = (image_paths if kind == VIT else []) + [path for _, path in records] \
        + (image_paths if kind == CAPTIONER else [])
    every_input = [*image_paths, *(path for _, path in records), *json_inputs]
    owner = OwnedFolder(out, "overlay", overwrite=overwrite, inputs=every_input)
    names, entries, bad_images = _png_names([str(source) for source in sources]), [], BadImageCounter()
    for name in [*(name for reserved in names.values() for name in reserved), "index.html"]:
        output_file(owner.path / name, inputs=every_input)  # refuse, before drawing anything, to write over an input
    policy = {"on_bad_image": on_bad_image, "bad_images": bad_images}
    with owner.staged() as staging:  # the PNGs and index replace the earlier overlays only when all are drawn

        def add(source: str, figure: Image.Image, text: str) -> None:
            name = names[str(source)].popleft()
            entries.append((name, text))
            save_png(figure, staging / name)
            if on_overlay is not None:
                on_overlay(source, text, owner.path / name)

        if kind == VIT:
            classifier = Classifier.from_checkpoint(checkpoint, device=device, loaded=loaded)
            gradient_class = classifier.class_index(options.gradient_class) if options.gradient_class else None
            for source, figure, text in vit_overlays(
                classifier, image_paths, head_fusion=options.head_fusion, discard_ratio=options.discard_ratio,
                gradient_class=gradient_class, batch_size=batch_size, **policy, **options.drawing,
            ):
                add(source, figure, text)
        elif kind == CAPTIONER:
            if options.gradient_class:
                raise ValueError("--gradient-class is for ViT checkpoints")
            captioner = Captioner.from_checkpoint(checkpoint, device=device, loaded=loaded)
            records += [(record, Path(record["file_name"])) for record in caption_files(
                captioner, expanded, beam_size=beam_size, batch_size=batch_size, **policy)]
        for record, path in records:
            image = load_or_skip(lambda path=path: open_image(path, mode="RGB", max_side=2 * options.panel_size),
                                 on_bad_image, bad_images)
            if image is not None:
                add(str(path), caption_overlay(image, record, **options.drawing), record.get("caption", ""))
        write_gallery(staging, entries)
    return OverlaysWritten(owner.path / "index.html", len(entries), bad_images.skipped_note())
