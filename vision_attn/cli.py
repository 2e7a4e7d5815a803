"""The ``vision-attn`` command. It only wires: each tool parses its options and calls one library function;
fit/validate/test/predict are LightningCLI (``trainer_cli.py``). Nothing heavy is imported before a command
needs it, so ``--help`` is instant and the inference tools never import Lightning.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from vision_attn.errors import exit_on_user_error
from vision_attn.options import at_least, number_in, parser_for

TOOLS: dict[str, tuple[Callable[[Sequence[str]], None], str]] = {}
LIGHTNING_COMMANDS = {"fit": "train a model (--config configs/...yaml)", "validate": "run the validation loop",
                      "test": "run the test loop (--ckpt_path C)", "predict": "run prediction"}


def tool(name: str, summary: str) -> Callable:
    """Register a subcommand: ``summary`` is its line in ``vision-attn --help``."""
    return lambda command: TOOLS.setdefault(name, (command, summary))[0]


@tool("classify", "top-k classes of images with a trained ViT")
def classify_command(argv: Sequence[str]) -> None:
    parser = parser_for("classify", "Top-k classes of images with a ViT.", "device")
    parser.add_argument("--ckpt", required=True, help="ViT checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--top-k", type=at_least(1), default=5, help="classes to print per image (default 5)")
    options = parser.parse_args(argv)
    from vision_attn.vit.inference import Classifier, classify_files

    classifier = Classifier.from_checkpoint(options.ckpt, device=options.device)
    for path, ranked in classify_files(classifier, options.images, top_k=options.top_k):
        print(path)
        for name, probability in ranked:
            print(f"  {probability:7.2%}  {name}")


@tool("caption", "caption images with a trained captioner; results JSON with attention")
def caption_command(argv: Sequence[str]) -> None:
    parser = parser_for("caption", "Caption images with a Show-Attend-Tell checkpoint; writes results JSON with "
                        "attention (SPEC §4).", "device", "bad_images", "beam", "batch_size")
    parser.add_argument("--ckpt", required=True, help="captioner checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("inputs", nargs="*", help="image files or folders of images")
    parser.add_argument("--coco-annotations", help="a COCO captions JSON: caption its images instead")
    parser.add_argument("--image-dir", help="the images of --coco-annotations")
    parser.add_argument("--out", default="results.json", help="results JSON to write (default results.json)")
    parser.add_argument("--all-beams", action="store_true",
                        help="also list every beam of each search (caption, tokens, α, β, score) under `beams`")
    options = parser.parse_args(argv)
    if bool(options.coco_annotations) != bool(options.image_dir):
        parser.error("--coco-annotations and --image-dir go together")
    if not options.inputs and not options.coco_annotations:
        parser.error("give image files or folders, or --coco-annotations with --image-dir")
    from vision_attn.captioning.evaluation import caption_inputs, write_captions

    inputs = caption_inputs(options.inputs, coco_annotations=options.coco_annotations, image_dir=options.image_dir)
    written = write_captions(options.ckpt, inputs, options.out, beam_size=options.beam, batch_size=options.batch_size,
                             on_bad_image=options.on_bad_image, device=options.device,
                             on_record=lambda record: print(f"{record['file_name']}: {record['caption']}"),
                             all_beams=options.all_beams)
    print(f"wrote {written.count} captions with attention to {written.path}{written.skipped_note}")


@tool("overlay", "attention over images: per word (captioner) or rollout and heads (ViT)")
def overlay_command(argv: Sequence[str]) -> None:
    parser = parser_for("overlay", "Attention over images, one PNG each and an index.html: per word for a captioner "
                        "(or `caption`'s JSON), rollout and last-layer heads for a ViT.", "device", "bad_images",
                        "head_fusion", "discard_ratio", "beam", "batch_size")
    parser.add_argument("inputs", nargs="+", help="image files, folders of images, or results JSON from `caption`")
    parser.add_argument("--ckpt", help="captioner or ViT checkpoint (not needed when every input is a results JSON)")
    parser.add_argument("--out", required=True, help="output folder for the PNGs and index.html")
    from vision_attn.gallery import OverlayOptions, draw_overlays

    OverlayOptions.add_arguments(parser)
    options = parser.parse_args(argv)
    style = OverlayOptions.from_arguments(options)
    written = draw_overlays(options.inputs, options.out, checkpoint=options.ckpt, options=style, beam_size=options.beam,
                            batch_size=options.batch_size, on_bad_image=options.on_bad_image, device=options.device,
                            on_overlay=lambda source, text, path: print(f"{source}: {text} -> {path}"))
    print(f"wrote {written.count} overlays and {written.page}{written.skipped_note}")


@tool("evaluate", "score any COCO results JSON: caption metrics; pointing and scene metrics with instances")
def evaluate_command(argv: Sequence[str]) -> None:
    parser = parser_for("evaluate", "Score a COCO results file (ours or another tool's) against COCO captions.")
    parser.add_argument("results", help="results JSON: [{image_id, caption}], or what `caption` writes")
    parser.add_argument("--annotations", required=True, help="COCO captions JSON holding the references")
    parser.add_argument("--instances", help="COCO instances JSON: scene metrics, and pointing for `caption`'s JSON")
    parser.add_argument("--attributes", help="the scenes' attributes JSON (the objects' colours)")
    parser.add_argument("--out", default="scores.json", help="scores JSON to write (default scores.json)")
    options = parser.parse_args(argv)
    from vision_attn.captioning.evaluation import evaluate_results, scores_table

    scores = evaluate_results(options.results, options.annotations, instances=options.instances,
                              attributes=options.attributes, out=options.out)
    print(f"{scores_table(scores)}\nwrote {options.out}")


@tool("explore", "an interactive attention explorer: a static site to open in a browser")
def explore_command(argv: Sequence[str]) -> None:
    parser = parser_for("explore", "Write the attention explorer, a static site (no network needed; open its "
                        "index.html from disk or serve the folder): each word's α over its image (captioner), or "
                        "rollout, layers and heads (ViT), drawn in the browser.", "device", "bad_images", "beam")
    parser.add_argument("results", nargs="?", help="results JSON written by `vision-attn caption` (SPEC §4)")
    parser.add_argument("--images", nargs="*", default=[],
                        help="with a results JSON: the folder its images are in (default: as `overlay` finds "
                             "them); with --ckpt: image files or folders to run the model on")
    parser.add_argument("--ckpt", help="run this checkpoint (captioner or ViT) on --images first")
    parser.add_argument("--instances", help="COCO instances JSON: the scene metrics of each image on the index")
    parser.add_argument("--attributes", help="the scenes' attributes JSON (the objects' colours)")
    parser.add_argument("--out", default="site", help="folder to write the site into (default site/)")
    options = parser.parse_args(argv)
    if options.results and len(options.images) > 1:
        parser.error("with a results JSON, --images is the one folder its images are in")
    if options.attributes and not options.instances:
        parser.error("--attributes goes with --instances")
    from vision_attn.explorer import explore

    site, count = explore(results=options.results, images=options.images, out=options.out,
                          checkpoint=options.ckpt, instances=options.instances, attributes=options.attributes,
                          beam_size=options.beam, device=options.device, on_bad_image=options.on_bad_image)
    print(f"wrote the attention explorer for {count} images: open {(site / 'index.html').resolve()} "
          f"(or serve it: python -m http.server -d {site})")


@tool("export-samples", "write dataset images as PNG files (for classify and overlay)")
def export_samples_command(argv: Sequence[str]) -> None:
    parser = parser_for("export-samples", "Write dataset images as PNG files named by their true class.")
    parser.add_argument("--dataset", choices=["fashion-mnist"], default="fashion-mnist")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--split", choices=["train", "test"], default="test")
    parser.add_argument("--count", type=at_least(1), default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=at_least(28), default=28,
                        help="paste each garment at a random place on a black square this big (default 28: as is)")
    parser.add_argument("--out", required=True, help="output folder")
    options = parser.parse_args(argv)
    from vision_attn.data.fashion_mnist import export_samples

    for path in export_samples(options.root, options.out, count=options.count, split=options.split,
                               seed=options.seed, canvas_size=options.canvas_size):
        print(path)


@tool("make-scenes", "generate the Fashion scenes captioning dataset")
def make_scenes_command(argv: Sequence[str]) -> None:
    parser = parser_for("make-scenes", "Generate the Fashion scenes captioning dataset (COCO format).")
    parser.add_argument("--root", default="data/fashion_scenes", help="output folder (default data/fashion_scenes)")
    for split, count in (("train", 20000), ("val", 1000), ("test", 1000)):
        parser.add_argument(f"--{split}", type=at_least(0), default=count, help=f"{split} scenes (default {count})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=at_least(1), default=96, help="canvas side in pixels (default 96)")
    parser.add_argument("--grid-size", type=at_least(1), default=3, help="grid cells per side (default 3)")
    parser.add_argument("--layout", choices=["grid", "free", "mixed"], default="grid",
                        help="items on grid cells (SPEC §3), anywhere without overlap, or either per scene")
    parser.add_argument("--shade-jitter", type=number_in(0, 1), default=0.0,
                        help="0: the exact tints; up to 1: other shades of each named colour")
    parser.add_argument("--hue-jitter", type=number_in(0, 1), default=0.0,
                        help="0: off; up to 1: tints from each named colour's whole family (hues, saturations, "
                             "values; instead of --shade-jitter)")
    parser.add_argument("--palette", choices=["exact", "css", "tab10", "dark", "pale"], default="exact",
                        help="the RGB each colour word names: the exact colours (SPEC §3's scenes), or another "
                             "maker's (CSS, matplotlib's tab10, darker, paler)")
    parser.add_argument("--scale-jitter", type=number_in(0, 0.5), default=0.0,
                        help="resize each item by a factor in [1 - j, 1 + j] (default 0)")
    parser.add_argument("--fashion-mnist-root", default="data/fashion_mnist",
                        help="where to look for Fashion-MNIST after the system location")
    options = parser.parse_args(argv)
    from vision_attn.data.scenes import make_scenes

    written = make_scenes(options.root, counts={"train": options.train, "val": options.val, "test": options.test},
                          seed=options.seed, canvas_size=options.canvas_size, grid_size=options.grid_size,
                          style={"layout": options.layout, "shade_jitter": options.shade_jitter,
                                 "scale_jitter": options.scale_jitter, "hue_jitter": options.hue_jitter,
                                 "palette": options.palette},
                          fashion_mnist_root=options.fashion_mnist_root)
    for split, counts in written.items():
        print(f"{split}: {counts['images']} images in {options.root}/images/{split}, {counts['captions']} captions "
              f"and {counts['instances']} objects in {options.root}/annotations/*_{split}.json")


@tool("rollout-mass", "ViT: does each attention map find Fashion-MNIST items placed on a larger canvas?")
def rollout_mass_command(argv: Sequence[str]) -> None:
    parser = parser_for("rollout-mass", "Does the ViT look at the garment? Accuracy, and the mass on the item and the "
                        "pointing game of rollout, gradient rollout and the last layer's attention, on Fashion-MNIST "
                        "items pasted at random on a larger canvas (SPEC §5).", "device", "head_fusion",
                        "discard_ratio")
    parser.add_argument("--ckpt", required=True, help="Fashion-MNIST ViT checkpoint")
    parser.add_argument("--canvas-size", type=at_least(28), default=56, help="canvas side in pixels (default 56)")
    parser.add_argument("--count", type=at_least(1), default=1000, help="test items to use (default 1000)")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--background-noise", type=at_least(0, 255), default=0, metavar="LEVEL",
                        help="fill every pixel but the item's with uniform grey noise up to LEVEL (0..255; default "
                             "0, black): the item's mask stays its own pixels")
    options = parser.parse_args(argv)
    from vision_attn.vit.inference import fashion_mnist_rollout_mass

    scores = fashion_mnist_rollout_mass(options.ckpt, root=options.root, count=options.count,
                                        canvas_size=options.canvas_size, seed=options.seed,
                                        head_fusion=options.head_fusion, discard_ratio=options.discard_ratio,
                                        background_noise=options.background_noise, device=options.device)
    noise = f" with grey noise up to {options.background_noise} around the item" if options.background_noise else ""
    print(f"{scores.images} Fashion-MNIST test items on {options.canvas_size}x{options.canvas_size} canvases{noise}: "
          f"accuracy {scores.accuracy:.2%}, the items' area share {scores.mask_area_share:.3f} (a blind map's mass)\n"
          f"{'map':<18} {'mass on the item':>16} {'pointing game':>14}")
    for name, found in scores.maps.items():
        print(f"{name:<18} {found.mass_in_mask:>16.3f} {found.pointing:>14.3f}")


@tool("cache-features", "fill a frozen encoder's feature cache ahead of fit (--config C, as fit takes it)")
def cache_features_command(argv: Sequence[str]) -> None:
    from vision_attn.trainer_cli import cache_features

    cache_features(argv)


@tool("benchmark", "measured speed side by side (markdown table + JSON; from a source checkout)")
def benchmark_command(argv: Sequence[str]) -> None:
    checkout = Path(__file__).resolve().parents[1]  # the benchmark reads benchmarks/ and configs/ there
    if not (checkout / "benchmarks" / "run.py").is_file():
        raise FileNotFoundError(f"{checkout / 'benchmarks'}: not found; the benchmark runs from a source checkout")
    sys.path.insert(0, str(checkout))
    from benchmarks.run import main as benchmark_main

    benchmark_main(list(argv))


def print_usage() -> None:
    print("usage: vision-attn COMMAND [options]\n\ncommands:")
    for name, text in {**LIGHTNING_COMMANDS, **{k: v[1] for k, v in TOOLS.items()}}.items():
        print(f"  {name:<15} {text}")
    print("\n`vision-attn COMMAND --help` shows a command's options.")


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point; ``args`` replaces ``sys.argv[1:]`` when called from Python."""
    argv = list(sys.argv[1:] if args is None else args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print_usage()
        return
    with exit_on_user_error():
        if argv[0] in TOOLS:
            TOOLS[argv[0]][0](argv[1:])
        else:
            from vision_attn.trainer_cli import run_lightning

            run_lightning(argv if args is not None else None)


if __name__ == "__main__":
    main()
