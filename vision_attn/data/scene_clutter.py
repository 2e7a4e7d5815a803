"""Cluttered Fashion scenes: items painted in order over a background, each with its non-zero pixels as alpha
(``compose``; with ``overlap`` each later one ringed in black where it lies over an earlier one), placed anywhere
(``place_free``), and their visible masks."""

from __future__ import annotations

import itertools

import numpy as np

FREE, OUTLINE = -1, -2  # who owns a pixel: nobody (the background), a later item's outline, or item k >= 0
PLACEMENT_TRIES, PLACEMENT_RESTARTS = 1000, 100  # per item, and per scene when an item finds no place
MIN_SEPARATION = 6  # two box centres are at least this far apart on some axis (pixels)


class _Layers:
    # Items painted in order, each later one on top (with ``outline``, ringed): who owns each pixel, and how many of
    # each item's are hidden. Arrays are padded by a pixel, so rings need no clipping.

    def __init__(self, size: int, *, outline: bool) -> None:
        self.owner = np.full((size + 2, size + 2), FREE, dtype=np.int16)
        self.outline = outline
        self.areas: list[int] = []
        self.hidden: list[int] = []

    def footprint(self, alpha: np.ndarray, top: int, left: int) -> tuple[tuple[slice, slice], np.ndarray, np.ndarray]:
        # Where an item of ``alpha`` (s, s) at (top, left) lands: the padded window, its pixels and outline there
        side = alpha.shape[0]
        window = (slice(top, top + side + 2), slice(left, left + side + 2))
        own = np.pad(alpha, 1)
        if not self.outline:
            return window, own, np.zeros_like(own)
        grown = np.lib.stride_tricks.sliding_window_view(np.pad(own, 1), (3, 3)).any(axis=(2, 3))  # 8-neighbours
        return window, own, grown & ~own & (self.owner[window] >= 0)

    def lost(self, alpha: np.ndarray, top: int, left: int) -> np.ndarray:
        # How many pixels each earlier item would lose to an item of ``alpha`` at (top, left)
        window, own, ring = self.footprint(alpha, top, left)
        under = self.owner[window][own | ring]
        return np.bincount(under[under >= 0], minlength=len(self.areas))

    def add(self, alpha: np.ndarray, top: int, left: int) -> None:
        # Paint the next item: its pixels become its own, its outline's ``OUTLINE``
        window, own, ring = self.footprint(alpha, top, left)
        self.hidden = [int(total) for total in np.add(self.hidden, self.lost(alpha, top, left))]
        owner = self.owner[window]
        owner[own] = len(self.areas)
        owner[ring] = OUTLINE
        self.areas.append(int(alpha.sum()))
        self.hidden.append(0)


def compose(background: np.ndarray, items: list[np.ndarray], corners: list[tuple[int, int]], *,
            outline: bool) -> tuple[np.ndarray, list[np.ndarray]]:
    """Tinted ``items`` painted in order over ``background`` at ``corners``: the image, and each item's mask."""
    image = background.copy()
    layers = _Layers(background.shape[0], outline=outline)
    for item, (top, left) in zip(items, corners, strict=True):
        alpha = item.any(axis=2)
        layers.add(alpha, top, left)
        image[top : top + alpha.shape[0], left : left + alpha.shape[1]][alpha] = item[alpha]
    owner = layers.owner[1:-1, 1:-1]
    image[owner == OUTLINE] = 0  # the outlines no later item painted over
    return image, [owner == k for k in range(len(items))]


def distinguish(background: np.ndarray, image: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
    """``background`` with each hidden pixel that equals the item's pixel over it changed by one level (in red),
    so that an item's mask is exactly where the image differs from its background; nothing visible changes."""
    same = np.any(masks, axis=0) & (background == image).all(axis=2)
    adjusted = background.copy()
    adjusted[same, 0] ^= 1
    return adjusted


def place_free(rng: np.random.Generator, items: list[np.ndarray], tight: list[tuple[int, int, int, int]],
               canvas_size: int, overlap: float) -> list[tuple[int, int]]:
    """Corners (top, left) for ``items`` anywhere on the canvas, by rejection sampling: box centres MIN_SEPARATION
    apart on some axis, and boxes apart (``overlap`` 0) or each item hiding at most ``overlap`` of every earlier one."""
    alphas = [item.any(axis=2) for item in items]
    for _ in range(PLACEMENT_RESTARTS):
        layers = _Layers(canvas_size, outline=overlap > 0)
        corners: list[tuple[int, int]] = []
        for alpha, (top, left, bottom, right) in zip(alphas, tight, strict=True):
            side = alpha.shape[0]
            for _ in range(PLACEMENT_TRIES):
                y, x = (int(v) for v in rng.integers(0, canvas_size - side + 1, size=2))
                centre = (y + (top + bottom) / 2, x + (left + right) / 2)
                if any(max(abs(centre[0] - (cy + (t + b) / 2)), abs(centre[1] - (cx + (lf + r) / 2)))
                       < MIN_SEPARATION for (cy, cx), (t, lf, b, r) in zip(corners, tight, strict=False)):
                    continue
                if not overlap:  # the items' boxes apart, by a pixel at least
                    if any(y + top <= cy + b and cy + t <= y + bottom and x + left <= cx + r and cx + lf <= x + right
                           for (cy, cx), (t, lf, b, r) in zip(corners, tight, strict=False)):
                        continue
                elif np.any(np.add(layers.hidden, layers.lost(alpha, y, x)) > overlap * np.array(layers.areas)):
                    continue  # an earlier item would lose more than ``overlap`` of its pixels
                layers.add(alpha, y, x)
                corners.append((y, x))
                break
            else:
                break
        if len(corners) == len(items):
            return corners
    raise ValueError(f"could not place items of sizes {[a.shape[0] for a in alphas]} on a {canvas_size}-pixel canvas "
                     f"in {PLACEMENT_RESTARTS} starts; use a larger canvas_size, fewer objects or smaller items")


def free_positions(rng: np.random.Generator, sizes: list[int], tight: list[tuple[int, int, int, int]],
                    canvas_size: int) -> list[tuple[int, int]]:
    """Corners (y, x) of items of ``sizes`` by rejection sampling: squares apart, box centres MIN_SEPARATION apart
    on some axis (the draws of free layouts of up to three items without overlap)."""
    for _ in range(PLACEMENT_TRIES):
        corners = [(int(rng.integers(0, canvas_size - size + 1)), int(rng.integers(0, canvas_size - size + 1)))
                   for size in sizes]
        centres = [(y + (top + bottom) / 2, x + (left + right) / 2)
                   for (y, x), (top, left, bottom, right) in zip(corners, tight, strict=True)]
        if all(max(abs(centres[i][0] - centres[j][0]), abs(centres[i][1] - centres[j][1])) >= MIN_SEPARATION
               and not (corners[i][0] < corners[j][0] + sizes[j] and corners[j][0] < corners[i][0] + sizes[i]
                        and corners[i][1] < corners[j][1] + sizes[j] and corners[j][1] < corners[i][1] + sizes[i])
               for i, j in itertools.combinations(range(len(sizes)), 2)):
            return corners
    raise ValueError(f"could not place items of sizes {sizes} on a {canvas_size}-pixel canvas without overlap "
                     f"in {PLACEMENT_TRIES} tries; use a larger canvas_size")


def mask_rle(mask: np.ndarray) -> dict:
    """A (H, W) bool mask as COCO's compressed RLE: {"size": [H, W], "counts": str}."""
    from pycocotools import mask as coco_mask
    encoded = coco_mask.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": [int(v) for v in encoded["size"]], "counts": encoded["counts"].decode("ascii")}
