"""The clutter protocol: a captioner scored on clean scenes, on clutter of the kinds the default trains on, on
clutter it never trains on (held out), and on scenes of 4-5 objects, with the causal erasure test on each; and a
canvas ViT's accuracy, rollout mass and deletion AUC on the same background families.

    python scripts/clutter_protocol.py --captioner CKPT --out runs/clutter_protocol [--count 300] [--seed 7]
    python scripts/clutter_protocol.py --vit CKPT --out runs/clutter_protocol_vit [--count 1000]

For each kind it writes ``--count`` test scenes (``make-scenes --seed``, in
``SCENES/scenes_<kind>_<count>_<seed>``, reused when they are there; ``--scenes`` defaults to ``--out``), then
runs ``caption``, ``evaluate`` and ``erasure`` on them; the ViT's canvases are drawn in memory (``rollout-mass``
and ``deletion``'s ``--background``). It writes ``OUT/protocol.json`` (every figure of
every kind) and ``OUT/protocol.md`` (the tables the README and the attention guide show). The kinds and their
groups are ``KINDS`` below; the training mixes are ``configs/captioner/fashion_scenes.yaml``'s and
``configs/vit/fashion_mnist_canvas.yaml``'s. Held out: the photographs shipped with matplotlib (the defaults train
on scikit-image's), noise up to 75% of white (held out while the defaults drew up to 50%; both defaults now draw up to
80%, so for them it is trained brightness), and gratings and checkerboards that this script paints under
clean scenes (``FOREIGN``: no generator of the project draws them). Also held out, and drawn
by ``held_out_scenes.py`` rather than the project's generator (``HELD_OUT``): grey noise and saturated colour at
40-75% of white, grey noise at 80-100% (brighter than any training draws), garments at half and at 1.3 times their
size, and six garments a scene; the ViT is scored on those of them that a one-item grey canvas can show.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from held_out_scenes import HELD_OUT, VIT_HELD_OUT, fashion_mnist_test, vit_scores, write_split

# name: (group, scene style: make-scenes' options as style fields, which the ViT's canvases read too)
KINDS = {
    "clean": ("clean", {}),
    "noise": ("trained clutter", {"background": "noise", "background_level": 0.25}),
    "texture": ("trained clutter", {"background": "texture", "texture_source": "skimage", "background_level": 0.25}),
    "distractors": ("trained clutter", {"background": "distractors", "background_level": 0.25}),
    "texture_matplotlib": ("held-out clutter", {"background": "texture", "texture_source": "matplotlib",
                                                "background_level": 0.25}),
    "noise_bright": ("held-out clutter", {"background": "noise", "background_level": 0.75}),
    "objects_4_5": ("4-5 objects", {"layout": "free", "objects": [4, 5]}),
}
# drawn by this script, not by the project's generator: clean scenes repainted over patterns no training draws
FOREIGN = {"gratings": ("held-out clutter", 0.25)}
SCORES = ("pointing_accuracy", "object_recall", "object_precision", "alpha_mass_in_box", "colour_accuracy",
          "repeated_object_rate", "CIDEr-D", "erasure")
HEADINGS = ("pointing", "recall", "precision", "α mass", "colour", "repeats", "CIDEr-D", "erasure")
VIT_SCORES = ("accuracy", "rollout_mass", "rollout_pointing", "last_layer_mass", "deletion_auc_rollout",
              "deletion_auc_random")
VIT_HEADINGS = ("accuracy", "rollout mass", "rollout pointing", "last layer mass", "deletion AUC, rollout",
                "deletion AUC, random")


def run(command: list[str], log: Path) -> None:
    """One vision-attn command, its output to ``log``; a failure stops the protocol with the log's last line."""
    tool = str(Path(sys.executable).parent / "vision-attn")
    with log.open("w") as out:
        done = subprocess.run([tool, *command], stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        last = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        sys.exit(f"vision-attn {command[0]} failed ({log}): {last[0]}")


def pattern(rng, size: int, level: float):
    """A background no training draws: a coloured sinusoidal grating at a random angle and period, or a
    checkerboard of two random colours at a random cell size and angle, dimmed to a level drawn up to ``level``."""
    import numpy as np

    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    angle = rng.uniform(0, np.pi)
    along, across = x * np.cos(angle) + y * np.sin(angle), -x * np.sin(angle) + y * np.cos(angle)
    period = rng.uniform(4, 24)
    if rng.random() < 0.5:
        wave = 0.5 + 0.5 * np.sin(2 * np.pi * along / period + rng.uniform(0, 2 * np.pi))  # (S, S) in [0, 1]
        image = wave[..., None] * rng.uniform(0.3, 1.0, size=3)
    else:
        cells = (np.floor(along / period) + np.floor(across / period)) % 2
        image = np.where(cells[..., None] > 0, rng.uniform(0, 1, size=3), rng.uniform(0, 1, size=3))
    return np.rint(255 * image * rng.uniform(0.3, 1.0) * level).astype(np.uint8)


def repaint(root: Path, level: float, seed: int) -> None:
    """Paint a ``pattern`` under every test scene of ``root`` (every pixel black in all channels, where no item
    lies), and write each pattern to ``backgrounds/test/`` for the erasure test."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([seed, 99])
    (root / "backgrounds" / "test").mkdir(parents=True, exist_ok=True)
    for path in sorted((root / "images" / "test").glob("*.png")):
        with Image.open(path) as opened:
            image = np.asarray(opened.convert("RGB"))
        under = pattern(rng, image.shape[0], level)
        Image.fromarray(np.where((image == 0).all(-1, keepdims=True), under, image)).save(path)
        Image.fromarray(under).save(root / "backgrounds" / "test" / path.name)


def scene_flags(style: dict) -> list[str]:
    """make-scenes' options for a style: {"background_level": 0.25} -> ["--background-level", "0.25"]."""
    flags = []
    for field, value in style.items():
        flags += [f"--{field.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    return flags


def captioner_kind(ckpt: str, out: Path, scenes: Path, kind: str, count: int, seed: int) -> dict:
    """Scenes of one kind (in ``scenes``), and the captioner's scores and erasure share on them."""
    root = scenes / f"scenes_{kind}_{count}_{seed}"
    if kind in HELD_OUT and not (root / "annotations" / "captions_test.json").is_file():
        write_split(root, kind, count, seed, *fashion_mnist_test())
    elif not (root / "annotations" / "captions_test.json").is_file():
        style = KINDS[kind][1] if kind in KINDS else {}
        run(["make-scenes", "--root", str(root), "--train", "0", "--val", "0", "--test", str(count), "--seed",
             str(seed), *scene_flags(style), "--overwrite"], out / f"make_{kind}.log")
        if kind in FOREIGN:
            repaint(root, FOREIGN[kind][1], seed)
    notes = root / "annotations"
    results, scores, erasure = out / f"results_{kind}.json", out / f"scores_{kind}.json", out / f"erasure_{kind}.json"
    run(["caption", "--ckpt", ckpt, "--coco-annotations", str(notes / "captions_test.json"), "--image-dir",
         str(root / "images" / "test"), "--out", str(results)], out / f"caption_{kind}.log")
    run(["evaluate", str(results), "--annotations", str(notes / "captions_test.json"), "--instances",
         str(notes / "instances_test.json"), "--attributes", str(notes / "attributes_test.json"), "--out",
         str(scores)], out / f"evaluate_{kind}.log")
    run(["erasure", "--ckpt", ckpt, "--root", str(root), "--split", "test", "--count", str(count), "--out",
         str(erasure)], out / f"erasure_{kind}.log")
    figures = json.loads(scores.read_text())
    return {**{key: figures[key] for key in SCORES[:-1]},
            "erasure": json.loads(erasure.read_text())["attended_drop_larger"]}


def vit_kind(ckpt: str, kind: str, count: int, seed: int) -> dict:
    """A canvas ViT on Fashion-MNIST test items over backgrounds of one kind: accuracy, map masses and pointing,
    and the deletion AUC of rollout and of a random map."""
    from vision_attn.data.backgrounds import Background
    from vision_attn.vit.rollout_mass import fashion_mnist_deletion, fashion_mnist_rollout_mass

    if kind in HELD_OUT:
        return vit_scores(ckpt, kind, count, seed)
    style = KINDS[kind][1]
    background = Background(style.get("background", "black"), style.get("background_level", 0.5),
                            style.get("texture_source", "skimage"))
    found = fashion_mnist_rollout_mass(ckpt, count=count, seed=seed, background=background)
    deleted = fashion_mnist_deletion(ckpt, count=min(count, 500), seed=seed, background=background)
    return {"accuracy": found.accuracy, "rollout_mass": found.maps["rollout"].mass_in_mask,
            "rollout_pointing": found.maps["rollout"].pointing,
            "last_layer_mass": found.maps["last layer"].mass_in_mask,
            "item_area_share": found.mask_area_share, "deletion_auc_rollout": deleted.area["rollout"],
            "deletion_auc_random": deleted.area["random"]}


def table(rows: dict[str, dict], scores: tuple[str, ...], headings: tuple[str, ...]) -> str:
    """A markdown table of every kind: its group, then the figures of ``scores`` under ``headings``."""
    lines = ["| scenes | group | " + " | ".join(headings) + " |", "| --- " * (len(headings) + 2) + "|"]
    for kind, row in rows.items():
        cells = ["–" if key not in row else f"{row[key]:.1%}" if key in ("repeated_object_rate", "accuracy")
                 else f"{row[key]:.3f}" for key in scores]
        lines.append(f"| {kind} | {row['group']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Score the checkpoints on every kind, and write the protocol's JSON and tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--captioner", help="a Fashion scenes captioner checkpoint (last.ckpt or best.ckpt)")
    parser.add_argument("--vit", help="a canvas ViT checkpoint (configs/vit/fashion_mnist_canvas.yaml's)")
    parser.add_argument("--out", required=True, help="the folder for the scenes, outputs and protocol.json")
    parser.add_argument("--scenes", help="where the test scenes go, to be reused by later runs (default: --out)")
    parser.add_argument("--count", type=int, default=None,
                        help="test scenes (300) or canvases (1000) of each kind, 1 to 5000")
    parser.add_argument("--seed", type=int, default=7, help="the scenes' and canvases' seed (the defaults train "
                                                            "on seed 0's)")
    every = [*KINDS, *FOREIGN, *HELD_OUT]
    parser.add_argument("--kinds", nargs="+", choices=every, default=every, help="the kinds to score")
    args = parser.parse_args()
    if not (args.captioner or args.vit):
        parser.error("give --captioner CKPT, --vit CKPT or both")
    for ckpt in filter(None, (args.captioner, args.vit)):
        if not Path(ckpt).is_file():
            parser.error(f"{ckpt}: no such checkpoint")
    if args.count is not None and not 1 <= args.count <= 5000:
        parser.error(f"--count must be from 1 to 5000, got {args.count}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    found: dict[str, dict] = {}
    for model, ckpt in (("captioner", args.captioner), ("vit", args.vit)):
        if not ckpt:
            continue
        count, rows = args.count or (300 if model == "captioner" else 1000), {}
        for kind in args.kinds:
            if model == "vit" and (kind in ("objects_4_5", *FOREIGN) or kind in HELD_OUT and kind not in VIT_HELD_OUT):
                continue  # one grey item a canvas; the foreign patterns are drawn for scenes only
            started = time.perf_counter()
            if model == "captioner":
                figures = captioner_kind(ckpt, out, Path(args.scenes or out), kind, count, args.seed)
            else:
                figures = vit_kind(ckpt, kind, count, args.seed)
            rows[kind] = {"group": {**KINDS, **FOREIGN, **HELD_OUT}[kind][0], **figures}
            print(f"{model} {kind}: {json.dumps(rows[kind])} ({time.perf_counter() - started:.0f} s)", flush=True)
        found[model] = {"ckpt": ckpt, "count": count, "kinds": rows}
    (out / "protocol.json").write_text(json.dumps({"seed": args.seed, **found}, indent=1) + "\n")
    tables = "".join(f"{model}, {found[model]['ckpt']}:\n\n" + table(found[model]["kinds"], *columns) + "\n"
                     for model, columns in (("captioner", (SCORES, HEADINGS)), ("vit", (VIT_SCORES, VIT_HEADINGS)))
                     if model in found)
    (out / "protocol.md").write_text(tables)
    print(tables)


if __name__ == "__main__":
    main()
