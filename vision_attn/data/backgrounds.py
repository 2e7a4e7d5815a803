"""What lies under the items of the Fashion scenes and of the ViT's Fashion-MNIST canvas, so that a model does not
learn "an object is whatever is not black" (``docs/formats/scenes.md``, "Backgrounds"): ``black``, ``noise``,
``texture`` (a crop of a photograph shipped in an installed package), ``distractors`` (strokes, arcs, blobs and
shuffled fragments of items), or ``mixed`` (one of the four per image), each at a level from 0 to ``level``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

DRAWN = ("black", "noise", "texture", "distractors")  # what ``mixed`` draws from, in the order of its weights
BACKGROUNDS = (*DRAWN, "mixed")
# The photographs each texture source offers, (package, folder, files): all in the packages' wheels, never fetched
TEXTURE_SOURCES = {
    "skimage": ("skimage", "data", ("astronaut.png", "brick.png", "camera.png", "cell.png", "chelsea.png",
                                    "clock_motion.png", "coffee.png", "coins.png", "grass.png", "gravel.png",
                                    "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png", "page.png",
                                    "retina.jpg", "rocket.jpg", "text.png")),
    "matplotlib": ("matplotlib", "mpl-data/sample_data", ("grace_hopper.jpg", "Minduka_Present_Blue_Pack.png")),
}
TEXTURE_PACKAGES = {"skimage": "scikit-image", "matplotlib": "matplotlib"}  # what to install for each source
MAX_GRAIN = 8  # noise: the coarsest grain, in pixels
DISTRACTORS = (3, 10)  # how many a distractors background holds, at least and at most
FRAGMENT_SIDES = (8, 16)  # the side of an item's crop that a fragment is cut from, in pixels


def texture_files(source: str) -> list[Path]:
    """The photographs of texture source ``source``; refuses an unknown source or a missing package or file."""
    if source not in TEXTURE_SOURCES:
        raise ValueError(f"texture_source must be one of {list(TEXTURE_SOURCES)}, got {source!r}")
    package, folder, names = TEXTURE_SOURCES[source]
    spec = importlib.util.find_spec(package)  # where it is installed, without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"texture_source {source!r} reads the images shipped with {TEXTURE_PACKAGES[source]}"
                                  f", which is not installed: pip install {TEXTURE_PACKAGES[source]}")
    files = [Path(spec.submodule_search_locations[0], folder, name) for name in names]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: not found; texture_source {source!r} needs the images that ship with "
                                f"{TEXTURE_PACKAGES[source]} (reinstall it)")
    return files


_known_texture_files = functools.lru_cache(maxsize=8)(texture_files)  # per draw: once found, the files stay


@functools.lru_cache(maxsize=32)
def read_texture(path: Path) -> tuple[np.ndarray, ...]:
    """A texture photograph as RGB uint8 (H, W, 3), decoded once per process, and its halvings to a side of 16."""
    with Image.open(path) as image:
        level = image.convert("RGB")
    levels = [np.asarray(level)]
    while min(level.size) >= 32:
        level = level.reduce(2)
        levels.append(np.asarray(level))
    return tuple(levels)


@dataclass(frozen=True)
class Background:
    """A background family: ``kind``, its brightest ``level`` (0..1 of white), the ``texture_source`` of
    ``texture``, and the ``weights`` of ``mixed`` (black, noise, texture, distractors; None: equal)."""

    kind: str = "black"
    level: float = 0.5
    texture_source: str = "skimage"
    weights: tuple[float, ...] | None = None

    def check(self, owner: str = "background") -> None:
        """Refuse, in one line naming ``owner``'s option, a field out of range or a texture source's missing files."""
        if self.kind not in BACKGROUNDS:
            raise ValueError(f"{owner} must be one of {list(BACKGROUNDS)}, got {self.kind!r}")
        if not (isinstance(self.level, int | float) and 0 <= self.level <= 1):
            raise ValueError(f"{owner}_level must be a number from 0 to 1 (a share of white), got {self.level!r}")
        weights = self.weights
        if weights is not None and self.kind != "mixed":
            raise ValueError(f"{owner}_weights are the odds of a mixed {owner}; {owner} is {self.kind!r}")
        if weights is not None and not (len(weights) == len(DRAWN) and all(
                isinstance(w, int | float) and math.isfinite(w) and w >= 0 for w in weights) and sum(weights) > 0):
            raise ValueError(f"{owner}_weights must be {len(DRAWN)} numbers of 0 or more ({', '.join(DRAWN)}) "
                             f"with a positive sum, got {weights!r}")
        if self.texture_source not in TEXTURE_SOURCES:
            raise ValueError(f"{owner.removesuffix('background')}texture_source must be one of "
                             f"{list(TEXTURE_SOURCES)}, got {self.texture_source!r}")
        if self.draws("texture"):
            texture_files(self.texture_source)

    def draws(self, kind: str) -> bool:
        """Whether this background ever draws ``kind`` (itself, or one of a mixed background's with a weight)."""
        if self.kind != "mixed":
            return self.kind == kind
        return self.weights is None or self.weights[DRAWN.index(kind)] > 0

    def draw(self, rng: np.random.Generator, size: int, *, channels: int = 3,
             fragments: np.ndarray | None = None) -> tuple[np.ndarray, str]:
        """One background uint8 (size, size, ``channels``) and its kind; distractors cut ``fragments`` (M, 28, 28)."""
        kind = self.kind
        if kind == "mixed":
            weights = np.ones(len(DRAWN)) if self.weights is None else np.asarray(self.weights, dtype=np.float64)
            kind = DRAWN[int(rng.choice(len(DRAWN), p=weights / weights.sum()))]
        if kind == "black":
            rgb = np.zeros((size, size, 3), dtype=np.uint8)
        elif kind == "noise":
            rgb = _noise(rng, size, self.level)
        elif kind == "texture":
            rgb = _texture(rng, size, self.level, _known_texture_files(self.texture_source))
        else:
            rgb = _distractors(rng, size, self.level, fragments)
        if channels == 1:
            rgb = np.asarray(Image.fromarray(rgb).convert("L"))[:, :, None]
        return rgb, kind


def _noise(rng: np.random.Generator, size: int, level: float) -> np.ndarray:
    grain = int(rng.integers(1, MAX_GRAIN + 1))
    coloured = bool(rng.random() < 0.5)
    small = math.ceil(size / grain)
    drawn = rng.integers(0, 256, size=(small, small, 3 if coloured else 1), dtype=np.uint8)
    image = Image.fromarray(drawn if coloured else drawn[:, :, 0]).resize((size, size), Image.Resampling.BILINEAR)
    noise = np.asarray(image.convert("RGB"), dtype=np.float64)
    return np.rint(noise * rng.uniform(0, level)).astype(np.uint8)


def _texture(rng: np.random.Generator, size: int, level: float, files: list[Path]) -> np.ndarray:
    levels = read_texture(files[int(rng.integers(len(files)))])
    height, width = levels[0].shape[:2]
    side = int(rng.integers(max(8, min(height, width) // 8), min(height, width) + 1))
    top, left = int(rng.integers(0, height - side + 1)), int(rng.integers(0, width - side + 1))
    halvings = 0  # the smallest level that still holds at least twice the canvas's pixels along a side
    while halvings + 1 < len(levels) and side >> (halvings + 1) >= 2 * size:
        halvings += 1
    top, left, side = top >> halvings, left >> halvings, max(1, side >> halvings)
    crop = Image.fromarray(np.ascontiguousarray(levels[halvings][top : top + side, left : left + side]))
    crop = crop.resize((size, size), Image.Resampling.BILINEAR)
    texture = np.asarray(crop, dtype=np.float64)
    if rng.random() < 0.5:
        texture = texture[:, ::-1]
    if rng.random() < 0.5:
        texture = texture[::-1]
    return np.rint(texture * rng.uniform(0, level)).astype(np.uint8)


def _fragment(rng: np.random.Generator, fragments: np.ndarray) -> np.ndarray:
    # A piece of a random item that is no garment: a crop cut in four tiles, shuffled and turned
    item = fragments[int(rng.integers(len(fragments)))]
    half = int(rng.integers(FRAGMENT_SIDES[0] // 2, FRAGMENT_SIDES[1] // 2 + 1))
    top, left = (int(v) for v in rng.integers(0, item.shape[0] - 2 * half + 1, size=2))
    crop = item[top : top + 2 * half, left : left + 2 * half]
    tiles = [crop[:half, :half], crop[:half, half:], crop[half:, :half], crop[half:, half:]]
    order = rng.permutation(4)
    shuffled = np.block([[tiles[order[0]], tiles[order[1]]], [tiles[order[2]], tiles[order[3]]]])
    return np.rot90(shuffled, int(rng.integers(4))).copy()


def _distractors(rng: np.random.Generator, size: int, level: float, fragments: np.ndarray | None) -> np.ndarray:
    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    kinds = 4 if fragments is not None and len(fragments) else 3
    for _ in range(int(rng.integers(DISTRACTORS[0], DISTRACTORS[1] + 1))):
        kind = int(rng.integers(kinds))
        colour = tuple(int(v) for v in np.rint(rng.integers(0, 256, size=3) * rng.uniform(0, level)))  # up to level
        width = int(rng.integers(1, 4))
        if kind == 0:  # a stroke through 2 to 4 points
            points = [tuple(int(v) for v in rng.integers(0, size, size=2)) for _ in range(int(rng.integers(2, 5)))]
            draw.line(points, fill=colour, width=width)
        elif kind in (1, 2):  # an arc, or a filled blob
            x0, y0 = (int(v) for v in rng.integers(-size // 8, size, size=2))
            x1, y1 = x0 + int(rng.integers(3, max(4, size // 3))), y0 + int(rng.integers(3, max(4, size // 3)))
            if kind == 1:
                start = int(rng.integers(0, 360))
                draw.arc([x0, y0, x1, y1], start, start + int(rng.integers(60, 300)), fill=colour, width=width)
            else:
                draw.ellipse([x0, y0, x1, y1], fill=colour)
        else:  # a fragment of an item, tinted
            piece = _fragment(rng, fragments)  # type: ignore[arg-type]
            side = piece.shape[0]
            tinted = Image.fromarray((piece[:, :, None].astype(np.uint16) * np.array(colour) // 255).astype(np.uint8))
            top, left = (int(v) for v in rng.integers(0, max(1, size - side + 1), size=2))
            image.paste(tinted, (left, top), Image.fromarray(np.where(piece > 0, 255, 0).astype(np.uint8)))
    return np.asarray(image).copy()


def _draw_backgrounds(background: Background, rng: np.random.Generator, items: torch.Tensor, size: int) -> torch.Tensor:
    # One ``background`` (B, C, size, size) uint8 per item of ``items`` (B, C, 28, 28), fragments cut from them
    pool = items.amax(dim=1).cpu().numpy()
    drawn = np.stack([background.draw(rng, size, channels=items.shape[1], fragments=pool)[0] for _ in items])
    return torch.from_numpy(drawn).permute(0, 3, 1, 2)


def fill_canvases(canvases: torch.Tensor, items: torch.Tensor, *, noise: int, background: Background,
                  pool: BackgroundPool | None = None) -> torch.Tensor:
    """Training canvases (B, C, S, S) uint8 with every uncovered pixel filled: with grey noise up to a level drawn
    per image up to ``noise`` (0..255), else with ``background`` (drawn per image, or from ``pool``), all from
    torch's generator (a numpy one seeded from it for backgrounds)."""
    around = (canvases == 0).all(dim=1, keepdim=True)  # uncovered: zero in every channel
    if noise:
        levels = torch.randint(0, noise + 1, (len(canvases), 1, 1, 1), device=canvases.device)
        grey = (torch.rand(canvases.shape, device=canvases.device) * (levels + 1)).to(torch.uint8)
        return torch.where(around, grey, canvases)
    if background.kind == "black":
        return canvases
    rng = np.random.default_rng(int(torch.randint(0, 2**62, ()).item()))
    drawn = _draw_backgrounds(background, rng, items, canvases.shape[-1]) if pool is None \
        else pool.draw(rng, items, canvases.shape[-1])
    return torch.where(around, drawn.to(canvases.device), canvases)


def check_reuse(reuse: object) -> None:
    """Refuse, in one line, a ``background_reuse`` that is not a whole number of 1 or more."""
    if not (isinstance(reuse, int) and not isinstance(reuse, bool) and reuse >= 1):
        raise ValueError(f"background_reuse must be a whole number of 1 or more, got {reuse!r}")


class BackgroundPool:
    """Training backgrounds reused, as drawing one is Python work: each batch draws ⌈B / ``reuse``⌉ new ones into a
    pool of ``capacity``, replacing random ones, and gives each image a random one under one of the square's eight
    symmetries."""

    def __init__(self, background: Background, *, reuse: int, capacity: int = 4096) -> None:
        check_reuse(reuse)
        self.background, self.reuse, self.capacity = background, reuse, capacity
        self.pool: torch.Tensor | None = None  # (capacity, C, S, S) uint8

    def draw(self, rng: np.random.Generator, items: torch.Tensor, size: int) -> torch.Tensor:
        """Backgrounds (B, C, size, size) uint8 for a batch of ``items`` (B, C, 28, 28)."""
        count = len(items)
        if self.pool is None or self.pool.shape[1:] != (items.shape[1], size, size):
            fill = [_draw_backgrounds(self.background, rng, items, size) for _ in range(-(-self.capacity // count))]
            self.pool = torch.cat(fill)[: self.capacity]
        else:
            fresh = min(-(-count // self.reuse), self.capacity)
            slots = torch.from_numpy(rng.choice(self.capacity, size=fresh, replace=False))
            self.pool[slots] = _draw_backgrounds(self.background, rng, items[:fresh], size)
        drawn = self.pool[torch.from_numpy(rng.integers(self.capacity, size=count))]
        symmetries = rng.integers(8, size=count)
        for symmetry in np.unique(symmetries):
            rows = torch.from_numpy(np.flatnonzero(symmetries == symmetry))
            turned = torch.rot90(drawn[rows], int(symmetry) % 4, dims=(2, 3))
            drawn[rows] = turned.flip(3) if symmetry >= 4 else turned
        return drawn


class TestCanvasFill:
    """What the test canvases' items lie on, the same for the same ``seed``: black, grey noise, or ``background``."""

    def __init__(self, seed: int, *, noise: int = 0, background: Background | None = None) -> None:
        self.check(noise, background)
        self.noise, self.background = noise, background or Background()
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.rng = np.random.default_rng(seed + 1)

    @staticmethod
    def check(noise: int, background: Background | None) -> None:
        """Refuse, in one line, a noise level outside 0..255, noise with a background, or a bad background."""
        if noise and background is not None and background.kind != "black":
            raise ValueError("background noise is grey noise on black: give it or a background, not both")
        if not 0 <= noise <= 255:
            raise ValueError(f"background noise is a grey level from 0 to 255, got {noise}")
        if background is not None:
            background.check("background")

    def fill(self, canvases: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``canvases`` (B, C, S, S) of ``items`` (B, C, 28, 28) with every uncovered pixel filled, and the fill."""
        if self.noise:
            drawn = torch.randint(0, self.noise + 1, canvases.shape, generator=self.generator, dtype=torch.uint8)
        elif self.background.kind != "black":
            drawn = _draw_backgrounds(self.background, self.rng, items, canvases.shape[-1])
        else:
            return canvases, torch.zeros_like(canvases)
        return torch.where((canvases == 0).all(dim=1, keepdim=True), drawn, canvases), drawn
