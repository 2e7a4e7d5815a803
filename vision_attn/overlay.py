"""Attention maps drawn over images: resize, smoothing, colour map, blending, layout. A heat map is a grid of weights
(Gh, Gw) over a box of the image: all of it for the captioner, the centre square for the ViT (its crop)."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from vision_attn.io import replace_atomically

Upsample = Literal["bilinear", "pyramid"]
Box = tuple[int, int, int, int]  # left, top, right, bottom in image pixels


def gaussian_blur(maps: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian smoothing (taps out to 3σ) of (B, 1, H, W) maps, edges replicated so mass does not leak."""
    if sigma <= 0:
        return maps
    radius = max(1, math.ceil(3 * sigma))
    kernel = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float32) / sigma) ** 2)
    kernel = (kernel / kernel.sum()).to(maps)
    height, width = maps.shape[-2:]
    rows = F.pad(maps, (0, 0, radius, radius), mode="replicate") if height > 1 else maps
    maps = F.conv2d(rows, kernel.view(1, 1, -1, 1)) if height > 1 else maps
    cols = F.pad(maps, (radius, radius, 0, 0), mode="replicate") if width > 1 else maps
    return F.conv2d(cols, kernel.view(1, 1, 1, -1)) if width > 1 else maps


def upsample_heatmap(weights: Tensor, size: tuple[int, int], *, mode: Upsample = "bilinear",
                     sigma: float | None = None) -> Tensor:
    """Grid weights (Gh, Gw) -> a map (H, W), smoothed by ``sigma`` pixels (default a quarter cell). ``bilinear``
    interpolates between cell centres; ``pyramid`` doubles the resolution in steps, each then blurred: a softer blob."""
    if weights.dim() != 2:
        raise ValueError(f"expected a (Gh, Gw) grid of weights, got shape {tuple(weights.shape)}")
    height, width = size
    if height < 1 or width < 1:
        raise ValueError(f"cannot draw a heat map on a {width}x{height} box")
    maps = weights.detach().float().cpu()[None, None]
    if mode == "pyramid":
        while maps.shape[-2] * 2 <= height and maps.shape[-1] * 2 <= width:
            maps = F.interpolate(maps, scale_factor=2, mode="bilinear", align_corners=False)
            maps = gaussian_blur(maps, 1.0)
    elif mode != "bilinear":
        raise ValueError(f"unknown upsampling {mode!r}: use 'bilinear' or 'pyramid'")
    maps = F.interpolate(maps, size=(height, width), mode="bilinear", align_corners=False)
    if sigma is None:
        sigma = 0.25 * min(height / weights.shape[0], width / weights.shape[1])
    return gaussian_blur(maps, sigma)[0, 0]


@lru_cache(maxsize=8)
def _colour_table(cmap: str) -> np.ndarray:
    import matplotlib
    try:
        colours = matplotlib.colormaps[cmap]
    except KeyError:
        raise ValueError(f"unknown colour map {cmap!r} (try turbo, inferno, viridis or jet)") from None
    return (colours(np.linspace(0.0, 1.0, 256))[:, :3] * 255).round().astype(np.uint8)


def colorize(heat: Tensor, cmap: str = "turbo") -> np.ndarray:
    """A map with values in [0, 1] -> RGB uint8 (H, W, 3) through a matplotlib colour map."""
    index = (heat.clamp(0, 1) * 255).round().to(torch.int64).numpy()
    return _colour_table(cmap)[index]


def heat_panel(image: Image.Image, weights: Tensor, *, box: Box | None = None, mode: Upsample = "bilinear",
               sigma: float | None = None, cmap: str = "turbo", opacity: float = 0.6) -> Image.Image:
    """``image`` with ``weights`` (Gh, Gw) over ``box`` (default all): min-max scaled to m ∈ [0, 1] (a flat map stays
    0), blended with opacity ``opacity · m``; outside the box, which the network never saw, the image is dimmed."""
    if not 0.0 <= opacity <= 1.0:
        raise ValueError(f"opacity must be in [0, 1], got {opacity}")
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)
    left, top, right, bottom = box or (0, 0, image.width, image.height)
    heat = upsample_heatmap(weights, (bottom - top, right - left), mode=mode, sigma=sigma)
    spread = heat.max() - heat.min()
    # flat: the spread is float32 rounding of the smoothing, which some CPUs' kernels leave on a constant map
    flat = spread <= 1e-5 * heat.abs().max()
    heat = torch.zeros_like(heat) if flat else (heat - heat.min()) / spread
    alpha = (opacity * heat).numpy()[..., None]
    region = rgb[top:bottom, left:right]
    blended = rgb * 0.45  # outside the box: dimmed
    blended[top:bottom, left:right] = region * (1 - alpha) + colorize(heat, cmap).astype(np.float32) * alpha
    return Image.fromarray(blended.round().clip(0, 255).astype(np.uint8))


def fit_within(image: Image.Image, longest_side: int) -> Image.Image:
    """``image`` resized to a longer side of ``longest_side`` (small images grow)."""
    scale = longest_side / max(image.size)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    resample = Image.Resampling.NEAREST if scale >= 4 else Image.Resampling.BICUBIC  # tiny images stay crisp
    return image.resize(size, resample)


@lru_cache(maxsize=4)
def _font(size: int) -> ImageFont.ImageFont:
    from matplotlib import font_manager
    try:
        return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)
    except OSError:  # no TrueType font found: Pillow's built-in one
        return ImageFont.load_default()


def _wrap(text: str, font: ImageFont.ImageFont, width: int, draw: ImageDraw.ImageDraw) -> list[str]:
    lines: list[str] = []
    for word in text.split() or [""]:
        if lines and draw.textlength(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def panel_grid(panels: Sequence[tuple[Image.Image, str]], *, columns: int = 5, header: str = "",
               font_size: int = 14, padding: int = 6) -> Image.Image:
    """Titled panels in rows of ``columns`` (wrapping), under an optional header line; white background."""
    if not panels:
        raise ValueError("no panels to lay out")
    columns, font, line_height = max(1, min(columns, len(panels))), _font(font_size), font_size + 4
    cell_width, cell_height = (max(sides) for sides in zip(*(image.size for image, _ in panels), strict=True))
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    header_lines = _wrap(header, font, columns * (cell_width + padding), measure) if header else []
    titles = [_wrap(title, font, cell_width, measure) for _, title in panels]
    title_height = max(map(len, titles)) * line_height + 2
    top = padding + len(header_lines) * line_height
    rows = math.ceil(len(panels) / columns)
    canvas = Image.new("RGB", (padding + columns * (cell_width + padding),
                               top + rows * (title_height + cell_height + padding)), "white")
    draw = ImageDraw.Draw(canvas)
    for index, line in enumerate(header_lines):
        draw.text((padding, padding + index * line_height), line, fill="black", font=font)
    for index, ((image, _), lines) in enumerate(zip(panels, titles, strict=True)):
        row, column = divmod(index, columns)
        x, y = padding + column * (cell_width + padding), top + row * (title_height + cell_height + padding)
        for line_index, line in enumerate(lines):
            draw.text((x, y + line_index * line_height), line, fill="black", font=font)
        canvas.paste(image, (x, y + title_height))
    return canvas


def save_png(image: Image.Image, path: str | os.PathLike) -> Path:
    """Write a PNG atomically: a crash never leaves a half-written file under the final name."""
    return replace_atomically(path, lambda handle: image.save(handle, format="PNG"))


def write_gallery(folder: str | os.PathLike, entries: Sequence[tuple[str, str]], *,
                  title: str = "vision-attn attention overlays") -> Path:
    """``index.html`` in ``folder`` showing each (PNG name, caption or class) entry, all text escaped."""
    items = "\n".join(
        f'<figure><a href="{html.escape(quote(name), quote=True)}"><img src="{html.escape(quote(name), quote=True)}" '
        f'alt="{html.escape(text, quote=True)}" loading="lazy"></a>'
        f"<figcaption>{html.escape(text)}</figcaption></figure>" for name, text in entries)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; background: #fafafa; }}
figure {{ margin: 0 0 2em 0; }}
img {{ max-width: 100%; border: 1px solid #ccc; background: white; }}
figcaption {{ font-size: 1.1em; margin-top: 0.3em; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{len(entries)} images</p>
{items}
</body></html>
"""
    return replace_atomically(Path(folder) / "index.html", lambda handle: handle.write(page.encode("utf-8")))


# --- the two models' figures ----------------------------------------------------------------------


def caption_overlay(image: Image.Image, record: dict[str, Any], *, panel_size: int = 224, columns: int = 5,
                    **style: Any) -> Image.Image:
    """The paper's figure for one results record: the image, then one panel per word with α_t, titled with the word
    and β_t; with ``head_alphas``, a row per head under the words' mean α. ``style`` goes to ``heat_panel``."""
    tokens, alphas, betas, grid = (record.get(key) for key in ("tokens", "alphas", "betas", "grid"))
    if not isinstance(tokens, list) or not isinstance(alphas, list) or not isinstance(grid, list) or len(grid) != 2:
        raise ValueError(f"{record.get('file_name') or record.get('image_id')}: the record has no tokens, alphas "
                         "and grid (write it with `vision-attn caption`)")
    if len(alphas) != len(tokens):
        raise ValueError(f"{record.get('file_name')}: {len(alphas)} α rows for {len(tokens)} tokens")
    betas = betas if isinstance(betas, list) and len(betas) == len(tokens) else [None] * len(tokens)
    heads = record.get("head_alphas")
    if heads is not None and not (isinstance(heads, list) and len(heads) == len(tokens) and heads
                                  and all(isinstance(h, list) and len(h) == len(heads[0]) for h in heads)):
        raise ValueError(f"{record.get('file_name')}: head_alphas must hold one list of K α rows per token")
    shown = fit_within(image.convert("RGB"), panel_size)
    panels = [(shown, "image")]
    for word, alpha, beta in zip(tokens, alphas, betas, strict=True):
        weights = torch.tensor(alpha, dtype=torch.float32)
        if weights.numel() != grid[0] * grid[1]:
            raise ValueError(f"{record.get('file_name')}: α row of {weights.numel()} values for a {grid} grid")
        title = word if beta is None else f"{word} (β {beta:.2f})"
        panels.append((heat_panel(shown, weights.view(*grid), **style), title + (" mean" if heads else "")))
    header = record.get("caption", " ".join(tokens))
    if not heads:
        return panel_grid(panels, columns=columns + 1 if len(panels) <= columns + 1 else columns, header=header)
    blank = Image.new("RGB", shown.size, "white")
    for k in range(len(heads[0])):  # one row per head, each word in the same column as its mean above
        panels += [(blank, "")] + [(heat_panel(shown, torch.tensor(word_heads[k], dtype=torch.float32).view(*grid),
                                               **style), f"{word} head {k + 1}")
                                   for word, word_heads in zip(tokens, heads, strict=True)]
    return panel_grid(panels, columns=len(tokens) + 1, header=header)


def vit_figure(shown: Image.Image, maps: Any, index: int, names: Sequence[str], *, title: str,
               box: Box | None = None, head_fusion: str = "mean", discard_ratio: float = 0.0,
               gradient_class: int | None = None, columns: int = 5, **style: Any) -> Image.Image:
    """Image ``index`` of ``AttentionMaps`` over ``shown``: rollout, gradient rollout if made, last layer's heads."""
    rollout_title = f"rollout ({head_fusion}" + (f", discard {discard_ratio:g})" if discard_ratio else ")")
    panels = [(shown, title), (heat_panel(shown, maps.rollout[index], box=box, **style), rollout_title)]
    if maps.gradient_rollout is not None and gradient_class is not None:
        panels.append((heat_panel(shown, maps.gradient_rollout[index], box=box, **style),
                       f"gradient rollout: {names[gradient_class]}"))
    panels += [(heat_panel(shown, weights, box=box, **style), f"last layer, head {head + 1}")
               for head, weights in enumerate(maps.heads[index])]
    return panel_grid(panels, columns=columns)


def log_figures(loggers: Sequence[object], figures: Sequence[tuple[str, Image.Image]], *, step: int,
                fallback_dir: str | os.PathLike | None = None) -> list[Path]:
    """Send figures to each logger with ``add_image`` (TensorBoard); for the others, or ``fallback_dir`` with no
    logger, write PNGs under ``<log_dir>/overlays/step<step>/`` and return them. Duck-typed: no Lightning here."""
    folders = []
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        if callable(getattr(experiment, "add_image", None)):
            for tag, figure in figures:
                experiment.add_image(tag, np.asarray(figure.convert("RGB")), step, dataformats="HWC")
        elif getattr(logger, "log_dir", None):
            folders.append(Path(logger.log_dir))
    if not loggers and fallback_dir is not None:
        folders.append(Path(fallback_dir))
    return [save_png(figure, folder / "overlays" / f"step{step}" / f"{tag.replace('/', '_')}.png")
            for folder in folders for tag, figure in figures]
