"""Held-out test scenes and canvases for the clutter protocol, drawn here by code that no training calls: bright
grey noise and bright saturated colour (at 40-75% of white, and grey noise at 80-100%, brighter than any training
draws), garments at sizes outside the trained range, and six garments a scene (training draws up to five).

The scenes are written in the Fashion scenes' format (``docs/formats/scenes.md``: images, captions, instances with
visible masks, attributes, and the backgrounds alone for the erasure test), from the Fashion-MNIST test items the
test split draws from (indices 5000-9999), so that ``caption``, ``evaluate`` and ``erasure`` read them like any
split. Items are resized with Pillow's Lanczos filter (the generator uses its own resize), tinted with the exact
colour of their colour word, and placed anywhere without overlap. The captions list every item ("there is a red
coat, a blue bag and a white boot"), in five orders.

``vit_scores`` scores a canvas ViT on single items drawn the same way on its 56-pixel canvases, in grey.
"""

from __future__ import annotations

import colorsys
import json
import math
from pathlib import Path

import numpy as np
from PIL import Image

from vision_attn.data.scene_clutter import mask_rle
from vision_attn.data.scenes import CLASS_WORDS, COLOURS, SOURCES
from vision_attn.data.scenes import ITEM_SIZE as ITEM

CANVAS, CANVAS_VIT = 96, 56
# kind: (its group in the protocol's tables, objects per scene (least, most), item scale (least, most), background:
# black, grey or colour, and its brightest pixel as a share of white, drawn per scene from (least, most))
BRIGHT = (0.4, 0.75)
HELD_OUT = {
    "noise_grey_40_75": ("held-out clutter", (2, 3), (1.0, 1.0), "grey", BRIGHT),
    "noise_colour_40_75": ("held-out clutter", (2, 3), (1.0, 1.0), "colour", BRIGHT),
    "scale_0.5": ("held-out sizes", (2, 3), (0.5, 0.5), "black", None),
    "scale_1.3": ("held-out sizes", (2, 3), (1.3, 1.3), "black", None),
    "objects_6": ("held-out counts", (6, 6), (0.7, 1.0), "black", None),
    "noise_grey_80_100": ("held-out clutter", (2, 3), (1.0, 1.0), "grey", (0.8, 1.0)),  # brighter than any training
}
VIT_HELD_OUT = ("noise_grey_40_75", "scale_0.5", "scale_1.3", "noise_grey_80_100")  # the ViT sees grey; one item
TEST_ITEMS = SOURCES["test"][1]  # the official test items the Fashion scenes' test split draws from


def background(rng: np.random.Generator, kind: str, size: int, levels: tuple[float, float] | None) -> np.ndarray:
    """(size, size, 3) uint8: black; grey noise whose brightest pixel is drawn from ``levels`` (shares of white), at
    a grain of 1-4 pixels; or blobs of saturated random hues at that brightness, at a grain of 3-8 pixels."""
    if kind == "black":
        return np.zeros((size, size, 3), np.uint8)
    level = rng.uniform(*levels)
    grain = int(rng.integers(1, 5) if kind == "grey" else rng.integers(3, 9))
    small = math.ceil(size / grain)
    if kind == "grey":
        cells = np.repeat(rng.uniform(0, 1, (small, small, 1)), 3, axis=2)
    else:
        hues, values = rng.uniform(0, 1, (small, small)), rng.uniform(0.5, 1, (small, small))
        cells = np.array([colorsys.hsv_to_rgb(h, 1.0, v) for h, v in zip(hues.ravel(), values.ravel(), strict=True)])
        cells = cells.reshape(small, small, 3)
    image = np.kron(cells, np.ones((grain, grain, 1)))[:size, :size]
    return np.rint(255 * level * image).astype(np.uint8)


def item_pixels(item: np.ndarray, size: int) -> np.ndarray:
    """A 28x28 uint8 Fashion-MNIST item at ``size`` pixels a side (Lanczos), as floats from 0 to 1."""
    resized = Image.fromarray(item).resize((size, size), Image.Resampling.LANCZOS)
    return np.asarray(resized, dtype=np.float64) / 255


def places(rng: np.random.Generator, sizes: list[int], canvas: int) -> list[tuple[int, int]] | None:
    """Top-left corners (y, x) of squares of ``sizes`` anywhere on the canvas without overlap; None when 1000
    draws find none."""
    for _ in range(1000):
        corners = [(int(rng.integers(0, canvas - s + 1)), int(rng.integers(0, canvas - s + 1))) for s in sizes]
        if all(not (a[0] < b[0] + sb and b[0] < a[0] + sa and a[1] < b[1] + sb and b[1] < a[1] + sa)
               for i, (a, sa) in enumerate(zip(corners, sizes, strict=True))
               for b, sb in zip(corners[i + 1:], sizes[i + 1:], strict=True)):
            return corners
    return None


def listing(names: list[str], form: int) -> str:
    """Every item named, in one of two forms: "there is a red coat, a blue bag and a white boot" or without
    "there is"."""
    phrases = [f"a {name}" for name in names]
    listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return f"there is {listed}" if form % 2 else listed


def write_split(root: Path, kind: str, count: int, seed: int, items: np.ndarray, labels: np.ndarray) -> None:
    """``count`` test scenes of ``kind`` under ``root``, in the Fashion scenes' format, from ``items`` (the test
    split's Fashion-MNIST pool) and their ``labels``."""
    _, objects, scales, ground, levels = HELD_OUT[kind]
    rng = np.random.default_rng([seed, 7331, list(HELD_OUT).index(kind)])
    for folder in ("images/test", "annotations", "backgrounds/test"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    info = {"description": f"held-out scenes ({kind}), test split", "seed": seed, "canvas_size": CANVAS,
            "grid_size": 3, "category_ids": "Fashion-MNIST label + 1", "held_out": kind, "backgrounds": True}
    images, captions, instances, attributes = [], [], [], []
    colours = list(COLOURS)
    for image_id in range(1, count + 1):
        while True:
            n = int(rng.integers(objects[0], objects[1] + 1))
            classes = rng.permutation(len(CLASS_WORDS))[:n]
            sizes = [round(ITEM * rng.uniform(*scales)) for _ in range(n)]
            corners = places(rng, sizes, CANVAS)
            if corners is not None:
                break
        under = background(rng, ground, CANVAS, levels)
        canvas, names, covered = under.copy(), [], np.zeros((CANVAS, CANVAS), bool)
        for label, size, (y, x) in zip(classes, sizes, corners, strict=True):
            pool = np.flatnonzero(labels == label)
            source = int(pool[rng.integers(len(pool))])
            colour = colours[int(rng.integers(len(colours)))]
            pixels = item_pixels(items[source], size)
            drawn = pixels > 0.02  # the item's own pixels (Lanczos rings below this are dropped)
            tinted = np.rint(pixels[..., None] * np.array(COLOURS[colour])).astype(np.uint8)
            window = canvas[y : y + size, x : x + size]
            window[drawn] = np.maximum(tinted[drawn], 1)  # never pure black, so that the mask is the item
            mask = np.zeros((CANVAS, CANVAS), bool)
            mask[y : y + size, x : x + size] = drawn
            covered |= mask
            rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
            box = [int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1), int(rows[-1] - rows[0] + 1)]
            annotation_id = len(instances) + 1
            instances.append({"id": annotation_id, "image_id": image_id, "category_id": int(label) + 1, "bbox": box,
                              "area": int(mask.sum()), "iscrowd": 0, "segmentation": mask_rle(mask)})
            attributes.append({"id": annotation_id, "image_id": image_id, "colour": colour,
                               "rgb": list(COLOURS[colour]), "cell": None, "source_split": "test",
                               "source_index": TEST_ITEMS.start + source})
            names.append(f"{colour} {CLASS_WORDS[label]}")
        for form in range(5):
            order = rng.permutation(n)
            captions.append({"id": len(captions) + 1, "image_id": image_id,
                             "caption": listing([names[k] for k in order], form)})
        alone = under.copy()
        alone[covered & (alone == canvas).all(axis=2)] ^= 1  # the background alone differs from each item pixel
        name = f"{image_id}.png"
        Image.fromarray(canvas).save(root / "images" / "test" / name)
        Image.fromarray(alone).save(root / "backgrounds" / "test" / name)
        images.append({"id": image_id, "file_name": name, "width": CANVAS, "height": CANVAS})
    categories = [{"id": k + 1, "name": word, "supercategory": "fashion"} for k, word in enumerate(CLASS_WORDS)]
    write = {"instances": {"info": info, "images": images, "annotations": instances, "categories": categories},
             "attributes": {"info": info, "colours": colours, "relation_phrases": [], "instances": attributes,
                            "relations": []},
             "captions": {"info": info, "images": images, "annotations": captions}}  # captions last: complete
    for what, data in write.items():
        (root / "annotations" / f"{what}_test.json").write_text(json.dumps(data, separators=(",", ":")))


def fashion_mnist_test() -> tuple[np.ndarray, np.ndarray]:
    """The official Fashion-MNIST test items and labels that the scenes' test split draws from."""
    from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist

    images, labels = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "test")
    return images.numpy()[TEST_ITEMS], labels.numpy()[TEST_ITEMS]


def vit_scores(ckpt: str, kind: str, count: int, seed: int) -> dict:
    """A canvas ViT on ``count`` single Fashion-MNIST test items of ``kind`` on grey 56-pixel canvases: its
    accuracy, and its rollout's mass on the item and pointing game (as ``rollout-mass`` scores them)."""
    import torch

    from vision_attn.data.classification_datasets import eval_transform
    from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
    from vision_attn.data.images import normalize
    from vision_attn.vit.classifier import Classifier
    from vision_attn.vit.rollout import explain
    from vision_attn.vit.rollout_mass import map_scores

    _, _, scales, ground, levels = HELD_OUT[kind]
    rng = np.random.default_rng([seed, 7331, 100 + list(HELD_OUT).index(kind)])
    images, labels = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "test")
    classifier = Classifier.from_checkpoint(ckpt)
    resize = eval_transform(classifier.image_size)
    correct, mass, pointing = 0, [], []
    for start in range(0, count, 250):
        filled, bare = [], []
        for index in range(start, min(count, start + 250)):
            size = round(ITEM * rng.uniform(*scales))
            pixels = item_pixels(images[index].numpy(), size)
            y, x = (int(v) for v in rng.integers(0, CANVAS_VIT - size + 1, size=2))
            canvas = background(rng, ground, CANVAS_VIT, levels)[..., 0]  # grey: one channel
            item = np.zeros((CANVAS_VIT, CANVAS_VIT), np.uint8)
            item[y : y + size, x : x + size] = np.rint(255 * pixels)
            canvas = np.where(item > 0, item, canvas)
            filled.append(canvas)
            bare.append(item)
        inputs = resize(torch.from_numpy(np.stack(filled))[:, None])
        masks = resize(torch.from_numpy(np.stack(bare))[:, None])[:, 0] > 0
        maps = explain(classifier.model, normalize(inputs, classifier.mean, classifier.std).to(classifier.device),
                       head_fusion="mean", discard_ratio=0.0, gradient_class="predicted")
        correct += int((maps.logits.argmax(-1).cpu() == labels[start : start + len(filled)]).sum())
        found, hit = map_scores(maps, masks)["rollout"]
        mass.append(found.cpu())
        pointing.append(hit.float().cpu())
    return {"accuracy": correct / count, "rollout_mass": float(torch.cat(mass).mean()),
            "rollout_pointing": float(torch.cat(pointing).mean())}
