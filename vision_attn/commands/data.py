"""The data and measurement tools: export-samples, make-scenes, rollout-mass, cache-features, benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from vision_attn.cli_arguments import BACKGROUND_KINDS, add_shared, at_least, bounded_int, number_in, parser_for
from vision_attn.commands import CANVAS_SIZE, canvas_background, tool


@tool("export-samples", "write dataset images as PNG files (for classify and overlay)")
def export_samples_command(argv: Sequence[str]) -> None:
    """``vision-attn export-samples``: write dataset images as PNG files and print their paths."""
    parser = parser_for("export-samples", "Write dataset images as PNG files named by their true class.",
                        "overwrite")
    parser.add_argument("--dataset", choices=["fashion-mnist"], default="fashion-mnist")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--split", choices=["train", "test"], default="test")
    parser.add_argument("--count", type=bounded_int(1, 60000, "Fashion-MNIST's largest split has 60000 images"),
                        default=8, help="images to write, 1 to 60000 (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=CANVAS_SIZE, default=28,
                        help="paste each garment at a random place on a black square this big, 28 to 1024 (default "
                             "28: as is)")
    parser.add_argument("--out", required=True, help="output folder")
    options = parser.parse_args(argv)
    from vision_attn.data.fashion_mnist import export_samples
    for path in export_samples(options.root, options.out, count=options.count, split=options.split,
                               seed=options.seed, canvas_size=options.canvas_size, overwrite=options.overwrite):
        print(path)


@tool("make-scenes", "generate the Fashion scenes captioning dataset")
def make_scenes_command(argv: Sequence[str]) -> None:
    """``vision-attn make-scenes``: generate the Fashion scenes dataset and print what each split holds."""
    parser = parser_for("make-scenes", "Generate the Fashion scenes captioning dataset (COCO format).")
    parser.add_argument("--root", default="data/fashion_scenes", help="output folder (default data/fashion_scenes)")
    for split, count in (("train", 20000), ("val", 1000), ("test", 1000)):
        parser.add_argument(f"--{split}", type=bounded_int(0, 100_000, "five times the default training set; more "
                                                                       "scenes only fill the disk"),
                            default=count, help=f"{split} scenes, 0 to 100000 (default {count})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=bounded_int(1, 1024, "the 28-pixel items are specks on a larger "
                                                                   "canvas, which only costs memory and disk"),
                        default=96, help="canvas side in pixels, up to 1024 (default 96)")
    parser.add_argument("--grid-size", type=bounded_int(1, 8, "a scene holds at most 5 items; more cells only "
                                                              "spread them thinner"),
                        default=3, help="grid cells per side, up to 8 (default 3)")
    parser.add_argument("--layout", choices=["grid", "free", "mixed"], default="grid",
                        help="items on grid cells (the default scenes), anywhere without overlap, or either per scene")
    parser.add_argument("--shade-jitter", type=number_in(0, 1), default=0.0,
                        help="0: the exact tints; up to 1: other shades of each named colour")
    parser.add_argument("--hue-jitter", type=number_in(0, 1), default=0.0,
                        help="0: off; up to 1: tints from each named colour's whole family (hues, saturations, "
                             "values; instead of --shade-jitter)")
    parser.add_argument("--palette", choices=["exact", "css", "tab10", "dark", "pale"], default="exact",
                        help="the RGB each colour word names: the exact colours (the default scenes'), or another "
                             "maker's (CSS, matplotlib's tab10, darker, paler)")
    parser.add_argument("--scale-jitter", type=number_in(0, 0.5), default=0.0,
                        help="resize each item by a factor in [1 - j, 1 + j] (default 0)")
    parser.add_argument("--scale", type=number_in(0, 2), nargs=2, default=[1.0, 1.0], metavar=("MIN", "MAX"),
                        help="resize each item by a factor from MIN to MAX instead (items of 10 to 56 pixels: MIN "
                             "at least 0.34, MAX at most 2; default 1 1)")
    parser.add_argument("--objects", type=bounded_int(1, 5, "more items crowd a 96-pixel canvas"), nargs=2,
                        default=[2, 3], metavar=("MIN", "MAX"), help="items per scene, 1 to 5 (default 2 3)")
    parser.add_argument("--overlap", type=number_in(0, 0.5), default=0.0,
                        help="free and mixed layouts: items may overlap, each later one on top with a black outline, "
                             "hiding at most this share of an item's pixels (0 to 0.5; default 0: never)")
    parser.add_argument("--background", choices=BACKGROUND_KINDS,
                        default="black", help="what lies under the items: black (the default scenes), noise, "
                                              "texture (photographs shipped with --texture-source), distractors "
                                              "(strokes, arcs, blobs, item fragments) or mixed (one per scene); a "
                                              "scene's background is also written alone, under backgrounds/<split>/")
    add_shared(parser, "background_level")
    parser.add_argument("--background-weights", type=number_in(0, 1000), nargs=4, default=None,
                        metavar=("BLACK", "NOISE", "TEXTURE", "DISTRACTORS"),
                        help="--background mixed: the odds of each kind (default: equal)")
    add_shared(parser, "texture_source")
    parser.add_argument("--fashion-mnist-root", default="data/fashion_mnist",
                        help="where to look for Fashion-MNIST after the system location")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the dataset in --root: the files an earlier make-scenes wrote there are "
                             "removed, so the new dataset is never mixed with the old; every other file is kept "
                             "(without it, a --root that holds anything is refused)")
    options = parser.parse_args(argv)
    from vision_attn.data.scenes import make_scenes
    style = {key: getattr(options, key) for key in ("layout", "shade_jitter", "scale_jitter", "hue_jitter", "palette",
                                                    "overlap", "background", "background_level", "background_weights",
                                                    "texture_source")}
    written = make_scenes(options.root, counts={split: getattr(options, split) for split in ("train", "val", "test")},
                          seed=options.seed, canvas_size=options.canvas_size, grid_size=options.grid_size,
                          style={**style, "scale": tuple(options.scale), "objects": tuple(options.objects)},
                          fashion_mnist_root=options.fashion_mnist_root, overwrite=options.overwrite)
    for split, counts in written.items():
        print(f"{split}: {counts['images']} images in {options.root}/images/{split}, {counts['captions']} captions "
              f"and {counts['instances']} objects in {options.root}/annotations/*_{split}.json")


@tool("rollout-mass", "ViT: does each attention map find Fashion-MNIST items placed on a larger canvas?")
def rollout_mass_command(argv: Sequence[str]) -> None:
    """``vision-attn rollout-mass``: a ViT's accuracy and each map's mass on the item and pointing game, on canvases."""
    parser = parser_for("rollout-mass", "Does the ViT look at the garment? Accuracy, and the mass on the item and the "
                        "pointing game of rollout, gradient rollout and the last layer's attention, on Fashion-MNIST "
                        "items pasted at random on a larger canvas (docs/formats/metrics.md).", "device", "head_fusion",
                        "discard_ratio", "canvas_background", "background_level", "texture_source")
    parser.add_argument("--ckpt", required=True, help="Fashion-MNIST ViT checkpoint")
    parser.add_argument("--canvas-size", type=CANVAS_SIZE, default=56,
                        help="canvas side in pixels, 28 to 1024 (default 56)")
    parser.add_argument("--count", type=bounded_int(1, 10000, "Fashion-MNIST's test split has 10000 items"),
                        default=1000, help="test items to use, 1 to 10000 (default 1000)")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--background-noise", type=at_least(0, 255), default=0, metavar="LEVEL",
                        help="fill every pixel but the item's with uniform grey noise up to LEVEL (0..255; default "
                             "0, black): the item's mask stays its own pixels")
    options = parser.parse_args(argv)
    from vision_attn.vit.rollout_mass import fashion_mnist_rollout_mass
    scores = fashion_mnist_rollout_mass(options.ckpt, root=options.root, count=options.count,
                                        canvas_size=options.canvas_size, seed=options.seed,
                                        head_fusion=options.head_fusion, discard_ratio=options.discard_ratio,
                                        background_noise=options.background_noise,
                                        background=canvas_background(options), device=options.device)
    noise = f" with grey noise up to {options.background_noise} around the item" if options.background_noise else ""
    if options.background != "black":
        noise = f" on {options.background} backgrounds up to {options.background_level:g} of white"
    print(f"{scores.images} Fashion-MNIST test items on {options.canvas_size}x{options.canvas_size} canvases{noise}: "
          f"accuracy {scores.accuracy:.2%}, the items' area share {scores.mask_area_share:.3f} (a blind map's mass)\n"
          f"{'map':<18} {'mass on the item':>16} {'pointing game':>14}")
    for name, found in scores.maps.items():
        print(f"{name:<18} {found.mass_in_mask:>16.3f} {found.pointing:>14.3f}")


@tool("cache-features", "fill a frozen encoder's feature cache ahead of fit (--config C, as fit takes it)")
def cache_features_command(argv: Sequence[str]) -> None:
    """``vision-attn cache-features``: fill a frozen encoder's feature cache for the fit config in ``argv``."""
    from vision_attn.trainer_cli import cache_features
    cache_features(argv)


@tool("benchmark", "measured speed side by side (markdown table + JSON; from a source checkout)")
def benchmark_command(argv: Sequence[str]) -> None:
    """``vision-attn benchmark``: a source checkout's ``benchmarks/run.py``, run as a program of its own."""
    checkout = Path(__file__).resolve().parents[2]  # the benchmark reads benchmarks/ and configs/ there
    if not (checkout / "benchmarks" / "run.py").is_file():
        raise FileNotFoundError(f"{checkout / 'benchmarks'}: not found; the benchmark runs from a source checkout")
    path = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])
    code = run_streamed([sys.executable, "-m", "benchmarks.run", *argv],
                        env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})
    if code:
        raise SystemExit(code)


def run_streamed(command: list[str], env: dict[str, str]) -> int:
    """Run ``command``, its output copied as it comes to ``sys.stdout`` and ``sys.stderr``; its exit code."""
    out, err = sys.stdout, sys.stderr
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as process:
        errors = threading.Thread(target=lambda: err.writelines(process.stderr))  # type: ignore[arg-type]
        errors.start()
        for line in process.stdout:  # type: ignore[union-attr]
            out.write(line)
            out.flush()
        errors.join()
    return process.returncode
