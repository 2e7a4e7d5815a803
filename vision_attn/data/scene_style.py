"""How the Fashion scenes draw their items: the colour words' RGB values, and the ``SceneStyle`` of a split
(its fields' meanings, ranges and the jitters' equations: ``docs/formats/scenes.md``, "Styles" and "Clutter")."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields

import numpy as np
from PIL import Image

from vision_attn.data.backgrounds import Background

ITEM_SIZE = 28  # a Fashion-MNIST item's side, in pixels
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
           "white": (255, 255, 255)}
PALETTES = {  # other makers' RGB for the same five words (the ``palette`` style option)
    "exact": COLOURS,
    "css": {**COLOURS, "green": (0, 128, 0)},
    "tab10": {"red": (214, 39, 40), "green": (44, 160, 44), "blue": (31, 119, 180), "yellow": (255, 215, 0),
              "white": (230, 230, 230)},
    "dark": {"red": (160, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 160), "yellow": (160, 160, 0),
             "white": (170, 170, 170)},
    "pale": {"red": (255, 80, 80), "green": (80, 255, 80), "blue": (90, 90, 255), "yellow": (255, 255, 100),
             "white": (255, 255, 255)},
}
LAYOUTS = ("grid", "free", "mixed")
SHADE_DEPTH, SHADE_SPREAD, SHADE_FLOOR = 80, 20, 45  # at shade_jitter 1: how far a tint may stray (``tints``)
# hue_jitter 1: each colour's family in HSV, (hue centre, hue half-width in degrees, lowest saturation, lowest
# value); white takes any hue and its saturation from 0 up to that of the table
HUE_FAMILIES = {"red": (0.0, 18.0, 0.5, 0.6), "yellow": (58.0, 10.0, 0.5, 0.75), "green": (120.0, 25.0, 0.5, 0.5),
                "blue": (225.0, 25.0, 0.5, 0.6), "white": (0.0, 180.0, 0.1, 0.75)}
MAX_SCALE_JITTER = 0.5
MAX_OBJECTS_PER_SCENE = 5  # more items crowd a 96-pixel canvas, and their captions outgrow a sentence
MIN_ITEM_SIDE, MAX_SCALE = 10, 2.0  # a smaller garment is a few pixels of noise; a larger one fills the canvas
MAX_OVERLAP = 0.5  # an item hidden more than half is hardly one a caption can name
# The fields a style had first: a split's info records the others only off their defaults (earlier bytes kept)
FIRST_FIELDS = ("layout", "shade_jitter", "scale_jitter", "hue_jitter", "palette")


@dataclass(frozen=True)
class SceneStyle:
    """How a split's scenes are drawn (the module's docstring); the default draws the default scenes."""

    layout: str = "grid"
    shade_jitter: float = 0.0
    scale_jitter: float = 0.0
    hue_jitter: float = 0.0
    palette: str = "exact"
    background: str = "black"
    background_level: float = 0.5
    background_weights: tuple[float, ...] | None = None
    texture_source: str = "skimage"
    objects: tuple[int, int] = (2, 3)
    scale: tuple[float, float] = (1.0, 1.0)
    overlap: float = 0.0

    def __post_init__(self) -> None:  # pairs and weights as tuples, as a config file's lists come
        for key in ("background_weights", "objects", "scale"):
            value = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, tuple(value))

    @classmethod
    def of(cls, options: SceneStyle | Mapping | None) -> SceneStyle:
        """A style from a style, a mapping of its fields (as in a config file), or None (the default)."""
        if options is None or isinstance(options, SceneStyle):
            return options or cls()
        known = [field.name for field in fields(cls)]
        unknown = set(options) - set(known)
        if unknown:
            raise ValueError(f"unknown scene style option(s) {sorted(unknown)}: use {', '.join(known)}")
        return cls(**options)

    def recorded(self) -> dict:
        """The style as a split's info records it: ``FIRST_FIELDS``, and the others not at their defaults."""
        default = SceneStyle()
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()
                if key in FIRST_FIELDS or value != getattr(default, key)}

    def differences(self, other: SceneStyle) -> dict[str, tuple[str, str]]:
        """Where this style differs from ``other``: field -> (this value, other's), as a config file writes them."""
        mine, theirs = asdict(self), asdict(other)
        return {name: (_shown(mine[name]), _shown(theirs[name])) for name in mine if mine[name] != theirs[name]}

    def background_spec(self) -> Background:
        """The style's background (``backgrounds.Background``)."""
        return Background(self.background, self.background_level, self.texture_source, self.background_weights)

    @property
    def scaled(self) -> bool:
        """Whether items are drawn at sizes other than 28 (``scale_jitter`` or ``scale``)."""
        return bool(self.scale_jitter) or tuple(self.scale) != (1.0, 1.0)

    def check(self, canvas_size: int, grid_size: int) -> None:
        """Refuse, in one line, a field out of range or at odds with another, or a canvas too small for the items."""
        if self.layout not in LAYOUTS:
            raise ValueError(f"scene layout must be one of {list(LAYOUTS)}, got {self.layout!r}")
        for name, most in (("shade_jitter", 1), ("hue_jitter", 1), ("scale_jitter", MAX_SCALE_JITTER)):
            if not 0 <= getattr(self, name) <= most:
                raise ValueError(f"{name} must be between 0 and {most}, got {getattr(self, name)}")
        if self.palette not in PALETTES:
            raise ValueError(f"palette must be one of {list(PALETTES)}, got {self.palette!r}")
        if self.palette != "exact" and (self.hue_jitter or self.shade_jitter):
            raise ValueError(f"the jitters draw shades of the exact colours: palette {self.palette!r} takes none")
        if self.hue_jitter and self.shade_jitter:
            raise ValueError("a style sets shade_jitter or hue_jitter, not both: hue_jitter draws the whole family "
                             "of each named colour, shade_jitter shades of its exact RGB value")
        self.background_spec().check("background")
        low, high = _pair(self.objects, "objects")
        if not (float(low).is_integer() and float(high).is_integer() and 1 <= low <= high <= MAX_OBJECTS_PER_SCENE):
            raise ValueError(f"objects must be [min, max] whole numbers with 1 <= min <= max <= "
                             f"{MAX_OBJECTS_PER_SCENE}, got {list(self.objects)}")
        low, high = _pair(self.scale, "scale")
        if not (round(ITEM_SIZE * low) >= MIN_ITEM_SIDE and low <= high <= MAX_SCALE):
            raise ValueError(f"scale must be [min, max] factors with min <= max, items at least {MIN_ITEM_SIDE} "
                             f"pixels (min >= {MIN_ITEM_SIDE / ITEM_SIZE:.2f}) and max <= {MAX_SCALE}, got "
                             f"{list(self.scale)}")
        if self.scale_jitter and tuple(self.scale) != (1.0, 1.0):
            raise ValueError("a style sets scale_jitter or scale, not both: both give the range of item sizes")
        if not (isinstance(self.overlap, int | float) and 0 <= self.overlap <= MAX_OVERLAP):
            raise ValueError(f"overlap must be a share from 0 to {MAX_OVERLAP} of an item's pixels, got "
                             f"{self.overlap!r}")
        if self.overlap and self.layout == "grid":
            raise ValueError("overlap needs layout free or mixed: on the grid each item has its own cell")
        largest, most = self.item_sizes()[1], int(self.objects[1])
        if self.layout != "grid" and most > 3 and not self.overlap and most * largest**2 > canvas_size**2 / 2:
            raise ValueError(f"a free layout of up to {most} items of up to {largest} pixels needs canvas_size of at "
                             f"least {math.ceil(largest * math.sqrt(2 * most))} (their squares on half the canvas), "
                             f"got {canvas_size}; use a larger canvas_size, fewer objects, smaller items or overlap")
        if self.layout != "free" and canvas_size // grid_size < largest:
            raise ValueError(f"canvas_size // grid_size must be at least {largest} (the largest item size), got "
                             f"{canvas_size} // {grid_size} = {canvas_size // grid_size}; use a larger "
                             "canvas_size or less scale_jitter")
        if self.layout != "grid" and canvas_size < 2 * largest:
            raise ValueError(f"a free layout needs canvas_size of at least {2 * largest} (two of the largest "
                             f"items side by side), got {canvas_size}")

    def item_sizes(self) -> tuple[int, int]:
        """The smallest and largest side an item may be drawn at, in pixels."""
        if tuple(self.scale) != (1.0, 1.0):
            return round(ITEM_SIZE * self.scale[0]), round(ITEM_SIZE * self.scale[1])
        return round(ITEM_SIZE * (1 - self.scale_jitter)), round(ITEM_SIZE * (1 + self.scale_jitter))

    def tint(self, rng: np.random.Generator, colour: str) -> np.ndarray:
        """The RGB (3,) an item of ``colour`` is tinted with: the exact value, or another shade of it."""
        return self.tints(rng, [colour])[0]

    def tints(self, rng: np.random.Generator, colours: Sequence[str]) -> np.ndarray:
        """The RGB tints (n, 3) of n items of ``colours``, drawn as ``tint`` draws one (the same draws for n = 1)."""
        if self.hue_jitter:
            return _hue_family_tints(rng, colours, self.hue_jitter)
        exact = np.array([PALETTES[self.palette][colour] for colour in colours], dtype=np.float64).reshape(-1, 3)
        if not self.shade_jitter:
            return exact.astype(np.uint16)
        level = 255 - rng.uniform(0, SHADE_DEPTH * self.shade_jitter, size=(len(exact), 1))
        spread = rng.uniform(0, SHADE_SPREAD * self.shade_jitter, size=(len(exact), 3))
        floor = rng.uniform(0, SHADE_FLOOR * self.shade_jitter, size=(len(exact), 3))
        return np.rint(np.where(exact > 0, level - spread, floor)).astype(np.uint16)


def _pair(value: object, name: str) -> tuple[float, float]:  # two numbers, or a refusal naming option ``name``
    if not (isinstance(value, tuple | list) and len(value) == 2
            and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
        raise ValueError(f"{name} must be two numbers [min, max], got {value!r}")
    return float(value[0]), float(value[1])


def _hue_family_tints(rng: np.random.Generator, colours: Sequence[str], jitter: float) -> np.ndarray:
    # The RGB tints (n, 3) of ``hue_jitter``: each drawn from its colour's family in HSV (``HUE_FAMILIES``)
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
    """A 28×28 grey item as a scene draws it: resized (bilinear), then tinted -> (size, size, 3) uint8."""
    item = np.asarray(Image.fromarray(item).resize((size, size), Image.Resampling.BILINEAR))  # a copy at 28
    return (item[:, :, None].astype(np.uint16) * tint // 255).astype(np.uint8)


def _shown(value: object) -> str:  # as a config file writes it: a pair as a list, a string bare
    return str(list(value)) if isinstance(value, tuple) else str(value)
