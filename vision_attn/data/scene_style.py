"""How the Fashion scenes draw their items: the colour words' RGB values, and the ``SceneStyle`` of a split.

A ``SceneStyle`` says how a split is drawn (``docs/formats/scenes.md``; the default scenes are ``SceneStyle()``):

- ``layout``: ``grid`` puts each item on its own cell of a G×G grid, at a random offset inside the cell, and
  relations follow from the cells; ``free`` puts items anywhere on the canvas without overlap, and relations
  follow from the box centres (along an axis on which the two items are clearly apart); ``mixed`` draws each
  scene one way or the other, with even odds.
- ``shade_jitter`` (0 to 1): each item's tint is another shade of its named colour instead of the pure RGB
  value: the named colour's channels are lowered by up to 80 (and apart by up to 20), the others raised by up
  to 45, scaled by the jitter. 0 gives the exact tints.
- ``hue_jitter`` (0 to 1): each item's tint is drawn from its named colour's family instead, in HSV: a hue within
  the colour's band (red 0° ± 18°, yellow 58° ± 10°, green 120° ± 25°, blue 225° ± 25°), saturation from 0.5
  and value from 0.5–0.75 (by colour: a dark yellow is olive) up to 1; white a grey of value from 0.75 and
  saturation up to 0.1, any hue. The bands and ranges scale with the jitter. A style sets this or
  ``shade_jitter``, not both.
- ``scale_jitter`` (0 to 0.5): each item is resized by a factor drawn from [1 − j, 1 + j] (bilinear).
- ``palette``: the RGB value each colour word names, ``exact`` (pure: red (255, 0, 0), ...) by default, or
  another maker's: ``css`` (CSS's named colours: green is (0, 128, 0)), ``tab10`` (matplotlib's tab:red,
  tab:green, tab:blue, gold and a light grey), ``dark`` (each pure colour at 63%), ``pale`` (pastels). Scenes that
  check colour naming on tints the training never drew; the jitters apply to ``exact`` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

ITEM_SIZE = 28  # a Fashion-MNIST item's side, in pixels
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
           "white": (255, 255, 255)}
PALETTES = {  # other makers' RGB for the same five words (the ``palette`` style option)
    "exact": COLOURS,
    "css": {"red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
            "white": (255, 255, 255)},
    "tab10": {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 180), "yellow": (255, 215, 0),
              "white": (230, 230, 230)},
    "dark": {"red": (160, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 160), "yellow": (160, 160, 0),
             "white": (170, 170, 170)},
    "pale": {"red": (255, 80, 80), "green": (80, 255, 80), "blue": (90, 90, 255), "yellow": (255, 255, 100),
             "white": (255, 255, 255)},
}
LAYOUTS = ("grid", "free", "mixed")
SHADE_DEPTH, SHADE_SPREAD, SHADE_FLOOR = 80, 20, 45  # at shade_jitter 1: how far a tint may stray (see above)
# hue_jitter 1: each colour's family in HSV, (hue centre, hue half-width in degrees, lowest saturation, lowest
# value); white takes any hue and its saturation from 0 up to that of the table (see above)
HUE_FAMILIES = {"red": (0.0, 18.0, 0.5, 0.6), "yellow": (58.0, 10.0, 0.5, 0.75), "green": (120.0, 25.0, 0.5, 0.5),
                "blue": (225.0, 25.0, 0.5, 0.6), "white": (0.0, 180.0, 0.1, 0.75)}
MAX_SCALE_JITTER = 0.5


@dataclass(frozen=True)
class SceneStyle:
    """How a split's scenes are drawn (see the module's docstring); the default draws the default scenes."""

    layout: str = "grid"
    shade_jitter: float = 0.0
    scale_jitter: float = 0.0
    hue_jitter: float = 0.0
    palette: str = "exact"

    @classmethod
    def of(cls, options: SceneStyle | Mapping | None) -> SceneStyle:
        """A style from a style, a mapping of its fields (as in a config file), or None (the default)."""
        if options is None or isinstance(options, SceneStyle):
            return options or cls()
        unknown = set(options) - {"layout", "shade_jitter", "scale_jitter", "hue_jitter", "palette"}
        if unknown:
            raise ValueError(f"unknown scene style option(s) {sorted(unknown)}: use layout, shade_jitter, "
                             "hue_jitter, scale_jitter, palette")
        return cls(**options)

    def check(self, canvas_size: int, grid_size: int) -> None:
        """Refuse, in one line, an unknown layout or palette, a jitter out of range or that does not fit the
        palette, or a canvas too small for the layout's largest items."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"scene layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        if not 0 <= self.shade_jitter <= 1:
            raise ValueError(f"shade_jitter must be between 0 and 1, got {self.shade_jitter}")
        if not 0 <= self.hue_jitter <= 1:
            raise ValueError(f"hue_jitter must be between 0 and 1, got {self.hue_jitter}")
        if self.palette not in PALETTES:
            raise ValueError(f"palette must be one of {list(PALETTES)}, got {self.palette!r}")
        if self.palette != "exact" and (self.hue_jitter or self.shade_jitter):
            raise ValueError(f"the jitters draw shades of the exact colours: palette {self.palette!r} takes none")
        if self.hue_jitter and self.shade_jitter:
            raise ValueError("a style sets shade_jitter or hue_jitter, not both: hue_jitter draws the whole family "
                             "of each named colour, shade_jitter shades of its exact RGB value")
        if not 0 <= self.scale_jitter <= MAX_SCALE_JITTER:
            raise ValueError(f"scale_jitter must be between 0 and {MAX_SCALE_JITTER}, got {self.scale_jitter}")
        largest = self.item_sizes()[1]
        if self.layout != "free" and canvas_size // grid_size < largest:
            raise ValueError(f"canvas_size // grid_size must be at least {largest} (the largest item size), got "
                             f"{canvas_size} // {grid_size} = {canvas_size // grid_size}; use a larger "
                             "canvas_size or less scale_jitter")
        if self.layout != "grid" and canvas_size < 2 * largest:
            raise ValueError(f"a free layout needs canvas_size of at least {2 * largest} (two of the largest "
                             f"items side by side), got {canvas_size}")

    def item_sizes(self) -> tuple[int, int]:
        """The smallest and largest side an item may be drawn at, in pixels."""
        return round(ITEM_SIZE * (1 - self.scale_jitter)), round(ITEM_SIZE * (1 + self.scale_jitter))

    def tint(self, rng: np.random.Generator, colour: str) -> np.ndarray:
        """The RGB (3,) an item of ``colour`` is tinted with: the exact value, or another shade of it."""
        return self.tints(rng, [colour])[0]

    def tints(self, rng: np.random.Generator, colours: Sequence[str]) -> np.ndarray:
        """The RGB tints (n, 3) of n items of ``colours``, drawn as ``tint`` draws one (the same draws for n = 1)."""
        if self.hue_jitter:
            return hue_family_tints(rng, colours, self.hue_jitter)
        exact = np.array([PALETTES[self.palette][colour] for colour in colours], dtype=np.float64).reshape(-1, 3)
        if not self.shade_jitter:
            return exact.astype(np.uint16)
        on = exact > 0
        level = 255 - rng.uniform(0, SHADE_DEPTH * self.shade_jitter, size=(len(exact), 1))
        spread = rng.uniform(0, SHADE_SPREAD * self.shade_jitter, size=(len(exact), 3))
        floor = rng.uniform(0, SHADE_FLOOR * self.shade_jitter, size=(len(exact), 3))
        return np.rint(np.where(on, level - spread, floor)).astype(np.uint16)


def hue_family_tints(rng: np.random.Generator, colours: Sequence[str], jitter: float) -> np.ndarray:
    """The RGB tints (n, 3) of ``hue_jitter``: each drawn from its named colour's family in HSV (module docstring)."""
    count = len(colours)
    centre, width, saturation, value = np.array([HUE_FAMILIES[colour] for colour in colours]).T
    white = np.array([colour == "white" for colour in colours])
    hue = centre + rng.uniform(-1, 1, size=count) * np.where(white, width, width * jitter)
    reach = rng.uniform(0, jitter, size=(2, count))  # how far toward the family's edge, for saturation and value
    saturation = np.where(white, saturation * reach[0], 1 - (1 - saturation) * reach[0])
    value = 1 - (1 - value) * reach[1]
    from matplotlib.colors import hsv_to_rgb  # here: drawing scenes without hue_jitter does not import matplotlib

    return np.rint(255 * hsv_to_rgb(np.stack([hue % 360.0 / 360.0, saturation, value], axis=1))).astype(np.uint16)


def draw_item(item: np.ndarray, tint: np.ndarray, size: int = ITEM_SIZE) -> np.ndarray:
    """A 28×28 grey item as a scene draws it: resized to size×size, then tinted with ``tint`` (RGB) -> (size,
    size, 3) uint8."""
    resized = resized_item(item, size)
    return (resized[:, :, None].astype(np.uint16) * tint // 255).astype(np.uint8)


def resized_item(item: np.ndarray, size: int) -> np.ndarray:
    """A 28×28 item resized to size×size (bilinear); the item itself when the size is unchanged."""
    if size == ITEM_SIZE:
        return item
    return np.asarray(Image.fromarray(item).resize((size, size), Image.Resampling.BILINEAR))
