"""The causal tests of attention, erasure (captioner) and deletion (ViT): what the model loses when what a map points
at is erased."""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vision_attn.cli_arguments import at_least, bounded_int, parser_for
from vision_attn.commands import CANVAS_SIZE, canvas_background, tool


@contextmanager
def progress_bar(unit: str) -> Any:
    """A callback ``(done, total)`` advancing a tqdm bar on a terminal, made at the first batch."""
    bars: list[Any] = []

    def advance(done: int, total: int) -> None:
        if not bars:
            from tqdm.auto import tqdm
            bars.append(tqdm(total=total, unit=unit, disable=None, leave=False))
        bars[0].update(done)

    try:
        yield advance
    finally:
        for bar in bars:
            bar.close()


def figure(value: float | None) -> str:
    """A measure for the table, to 3 decimals: ``n/a`` when there was nothing to count."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


@tool("erasure", "captioner: does erasing the object α points at lower the word more than erasing another?")
def erasure_command(argv: Sequence[str]) -> None:
    """``vision-attn erasure``: the erasure test of a captioner's α on a Fashion scenes split; a table and JSON."""
    parser = parser_for("erasure", "Does the captioner's α show what its words rest on? For each class word of each "
                        "scene's beam-search caption, erase (fill with the scene's background) the object α points at, "
                        "then another object of the scene, re-score the same caption by teacher forcing, and compare "
                        "the word's drops in log-probability (docs/formats/metrics.md).", "device", "bad_images",
                        "beam")
    parser.add_argument("--ckpt", required=True, help="captioner checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("--root", required=True, help="Fashion scenes root, as `vision-attn make-scenes` writes it")
    parser.add_argument("--split", choices=["train", "val", "test"], default="test", help="scenes split (default test)")
    parser.add_argument("--count", type=bounded_int(1, 100_000, "make-scenes writes at most 100000 scenes a split"),
                        help="scenes to use, the split's first, 1 to 100000 (default: all)")
    parser.add_argument("--batch-size", type=bounded_int(1, 256, "each image brings two erased copies per class "
                                                                  "word into the same encoder pass"),
                        default=16, help="scenes per batch, 1 to 256 (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="picks the other object of scenes with several (default 0)")
    parser.add_argument("--out", default="erasure.json", help="JSON to write (default erasure.json)")
    options = parser.parse_args(argv)
    from vision_attn.captioning.erasure import erasure_test, write_erasure
    from vision_attn.data.scenes import dataset_files
    from vision_attn.io import output_file
    root = Path(options.root)  # the dataset's files are inputs: the report never replaces one of them
    dataset = [root / name for name in dataset_files(root)] if root.is_dir() else []
    out = output_file(options.out, inputs=[options.ckpt, *dataset])
    with progress_bar("scene") as advance:
        report = erasure_test(options.ckpt, options.root, split=options.split, count=options.count,
                              beam_size=options.beam, batch_size=options.batch_size, seed=options.seed,
                              device=options.device, on_bad_image=options.on_bad_image, on_batch=advance)
    found = report.summary
    skipped = found["skipped"]
    print(f"{found['images']} {options.split} scenes, {found['words']} class words scored "
          f"({skipped['single_object']} skipped: one object; {skipped['no_attended_object']}: α on no object)\n"
          f"{'attended object erased: larger drop':<40} {figure(found['attended_drop_larger'])}\n"
          f"{'mean drop, attended object erased':<40} {figure(found['mean_drop_attended'])}\n"
          f"{'mean drop, other object erased':<40} {figure(found['mean_drop_other'])}\n"
          f"{'attended object is the one named':<40} {figure(found['attended_is_named'])}")
    print(f"wrote {write_erasure(out, report)}")


@tool("deletion", "ViT: deletion curves of rollout, gradient rollout, last-layer attention and a random map")
def deletion_command(argv: Sequence[str]) -> None:
    """``vision-attn deletion``: each map's area under the deletion curve on Fashion-MNIST canvases; table and JSON."""
    parser = parser_for("deletion", "Do the ViT's maps point at what its decision rests on? On Fashion-MNIST items "
                        "pasted at random on a larger canvas, erase the patches each map ranks first, a few more at "
                        "each step, and follow the probability of the class first predicted; the area under that "
                        "curve is lower for a map that points at what matters, a random map the baseline "
                        "(docs/formats/metrics.md).", "device", "head_fusion", "discard_ratio", "batch_size",
                        "canvas_background", "background_level", "texture_source")
    parser.add_argument("--ckpt", required=True, help="Fashion-MNIST ViT checkpoint")
    parser.add_argument("--canvas-size", type=CANVAS_SIZE, default=56,
                        help="canvas side in pixels, 28 to 1024 (default 56)")
    parser.add_argument("--count", type=bounded_int(1, 10000, "Fashion-MNIST's test split has 10000 items"),
                        default=1000, help="test items to use, 1 to 10000 (default 1000)")
    parser.add_argument("--steps", type=bounded_int(1, 256, "each step is one more forward pass per map; the curve "
                                                            "is smooth long before"),
                        default=16, help="points of the curve after k = 0, 1 to 256, at most one a patch (default 16)")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--seed", type=int, default=0, help="the items' places and the random map (default 0)")
    parser.add_argument("--background-noise", type=at_least(0, 255), default=0, metavar="LEVEL",
                        help="draw the canvas as uniform grey noise up to LEVEL (0..255; default 0, black); erased "
                             "patches are filled with it")
    parser.add_argument("--out", default="deletion.json", help="JSON to write (default deletion.json)")
    options = parser.parse_args(argv)
    from vision_attn.data.fashion_mnist import FILES, find_fashion_mnist
    from vision_attn.errors import DatasetNotFoundError
    from vision_attn.io import output_file, write_json_atomically
    from vision_attn.vit.rollout_mass import fashion_mnist_deletion
    try:  # Fashion-MNIST's files are inputs too (where they are found now; a download comes later)
        source = find_fashion_mnist(options.root, download=False)
    except DatasetNotFoundError:
        source = None
    dataset = [source / name for pair in FILES.values() for name in pair] if source else []
    out = output_file(options.out, inputs=[options.ckpt, *dataset])
    with progress_bar("image") as advance:
        scores = fashion_mnist_deletion(options.ckpt, root=options.root, count=options.count,
                                        canvas_size=options.canvas_size, steps=options.steps, seed=options.seed,
                                        head_fusion=options.head_fusion, discard_ratio=options.discard_ratio,
                                        background_noise=options.background_noise,
                                        background=canvas_background(options), batch_size=options.batch_size,
                                        device=options.device, on_batch=advance)
    print(f"{scores.images} Fashion-MNIST test items on {options.canvas_size}x{options.canvas_size} canvases: "
          f"accuracy {scores.accuracy:.2%}; {scores.counts[-1]} patches erased in {len(scores.counts) - 1} steps\n"
          f"{'map':<18} {'deletion AUC':>12}  (lower: the map finds what the decision rests on)")
    for name, area in scores.area.items():
        print(f"{name + ' (baseline)' * (name == 'random'):<18} {area:>12.3f}")
    written = write_json_atomically(out, {
        "images": scores.images, "accuracy": scores.accuracy, "canvas_size": options.canvas_size,
        "background_noise": options.background_noise, "background": options.background,
        "background_level": options.background_level, "texture_source": options.texture_source,
        "patches": scores.counts[-1],
        "fractions": [k / scores.counts[-1] for k in scores.counts],
        "maps": {name: {"auc": scores.area[name], "curve": scores.curves[name]} for name in scores.area}})
    print(f"wrote {written}")
