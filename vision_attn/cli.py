"""The ``vision-attn`` command: LightningCLI for fit/validate/test/predict, plus the inference tools.

    vision-attn fit --config configs/vit/fashion_mnist.yaml [--trainer.max_epochs 1 ...]
    vision-attn classify --ckpt model.ckpt image.png ...

The YAML picks the LightningModule and the LightningDataModule by ``class_path``; the DataModule's
metadata (classes, channels, image size, normalisation) is linked into the model.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO

# DataModule attribute -> model argument. A link is skipped when the DataModule lacks the attribute, but
# a model that lacks the argument gets an error: every model must accept every target its data can send.
LINKED_FROM_DATA = {
    "num_classes": "num_classes",
    "class_names": "class_names",
    "in_chans": "in_chans",
    "mean": "mean",
    "std": "std",
    "image_size": "image_size",
    "vocab_tokens": "vocabulary",
}


KIND_OF_MODEL = {"ViTClassifier": "vit", "ShowAttendTell": "captioner"}


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written to a temporary file beside the target, then renamed: a crash (even SIGKILL)
    mid-write leaves the previous checkpoint whole. Remote paths (``s3://`` ...) keep Lightning's own writer."""

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: object | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        from vision_attn.io import replace_atomically

        replace_atomically(path, lambda file: torch.save(checkpoint, file))


class VisionAttnCLI(LightningCLI):
    """LightningCLI with the DataModule → model links of ``LINKED_FROM_DATA``, and a ``--ckpt_path`` check."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse's parser
        for source, target in LINKED_FROM_DATA.items():
            parser.link_arguments(f"data.{source}", f"model.init_args.{target}", apply_on="instantiate")

    def instantiate_trainer(self, **kwargs: object) -> L.Trainer:
        """The configured Trainer, with checkpoints written atomically unless the config picks plugins."""
        trainer_config = self._get(self.config_init, "trainer", default={})
        if not trainer_config.get("plugins") and "plugins" not in kwargs:
            kwargs["plugins"] = [AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def _parse_ckpt_path(self) -> None:
        """Before LightningCLI takes the model's hyper-parameters from ``--ckpt_path``: the checkpoint must be a
        weights-only file of the model family the config trains (else the config's data meets another model)."""
        from vision_attn.checkpoint import KIND_KEY, load_file, require_kind

        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path not in ("last", "best", "hpc", "registry") and Path(ckpt_path).is_file():
            found = load_file(ckpt_path).get(KIND_KEY)
            model = self.config[subcommand].get("model") or {}
            class_path = model.get("class_path", "") if isinstance(model, dict) else getattr(model, "class_path", "")
            wanted = KIND_OF_MODEL.get(str(class_path).rsplit(".", 1)[-1])
            if wanted:
                require_kind(found, wanted, source=ckpt_path, training=True)
        super()._parse_ckpt_path()


def run_lightning(args: Sequence[str] | None) -> None:
    VisionAttnCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


def classify_command(argv: Sequence[str]) -> None:
    from vision_attn.vit.inference import classify_files, load_classifier

    parser = argparse.ArgumentParser(prog="vision-attn classify", description="Top-k classes of images with a ViT.")
    parser.add_argument("--ckpt", required=True, help="ViT checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--top-k", type=int, default=5, help="classes to print per image (default 5)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    options = parser.parse_args(argv)
    module = load_classifier(options.ckpt, device=options.device)
    for path, ranked in classify_files(module, options.images, top_k=options.top_k):
        print(path)
        for name, probability in ranked:
            print(f"  {probability:7.2%}  {name}")


def export_samples_command(argv: Sequence[str]) -> None:
    from vision_attn.data.fashion_mnist import export_samples

    parser = argparse.ArgumentParser(prog="vision-attn export-samples",
                                     description="Write dataset images as PNG files named by their true class.")
    parser.add_argument("--dataset", choices=["fashion-mnist"], default="fashion-mnist")
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--split", choices=["train", "test"], default="test")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=int, default=28,
                        help="paste each garment at a random place on a black square this big (default 28: as is)")
    parser.add_argument("--out", required=True, help="output folder")
    options = parser.parse_args(argv)
    for path in export_samples(options.root, options.out, count=options.count, split=options.split,
                               seed=options.seed, canvas_size=options.canvas_size):
        print(path)


def make_scenes_command(argv: Sequence[str]) -> None:
    from vision_attn.data.scenes import make_scenes

    parser = argparse.ArgumentParser(prog="vision-attn make-scenes",
                                     description="Generate the Fashion scenes captioning dataset (COCO format).")
    parser.add_argument("--root", default="data/fashion_scenes", help="output folder (default data/fashion_scenes)")
    parser.add_argument("--train", type=int, default=20000, help="training scenes (default 20000)")
    parser.add_argument("--val", type=int, default=1000, help="validation scenes (default 1000)")
    parser.add_argument("--test", type=int, default=1000, help="test scenes (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canvas-size", type=int, default=96, help="canvas side in pixels (default 96)")
    parser.add_argument("--grid-size", type=int, default=3, help="grid cells per side (default 3)")
    parser.add_argument("--fashion-mnist-root", default="data/fashion_mnist",
                        help="where to look for Fashion-MNIST after the system location")
    options = parser.parse_args(argv)
    written = make_scenes(options.root, counts={"train": options.train, "val": options.val, "test": options.test},
                          seed=options.seed, canvas_size=options.canvas_size, grid_size=options.grid_size,
                          fashion_mnist_root=options.fashion_mnist_root)
    for split, counts in written.items():
        print(f"{split}: {counts['images']} images in {options.root}/images/{split}, {counts['captions']} captions "
              f"and {counts['instances']} objects in {options.root}/annotations/*_{split}.json")


def add_bad_image_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--on-bad-image", choices=["error", "skip"], default="error",
                        help="an unreadable image stops the run (default) or is skipped with a warning")


def add_rollout_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-fusion", choices=["mean", "max", "min"], default="mean",
                        help="ViT rollout: how the heads of a layer are fused (default mean)")
    parser.add_argument("--discard-ratio", type=float, default=0.0,
                        help="ViT rollout: fraction of the weakest attention links dropped per layer")


def caption_command(argv: Sequence[str]) -> None:
    from vision_attn.captioning.inference import caption_files, coco_inputs, load_captioner
    from vision_attn.data.images import BadImageCounter, expand_inputs
    from vision_attn.io import write_json_atomically

    parser = argparse.ArgumentParser(
        prog="vision-attn caption",
        description="Caption images with a Show-Attend-Tell checkpoint; writes results JSON with attention (SPEC §4).",
    )
    parser.add_argument("--ckpt", required=True, help="captioner checkpoint (.ckpt) written by `vision-attn fit`")
    parser.add_argument("inputs", nargs="*", help="image files or folders of images")
    parser.add_argument("--coco-annotations", help="a COCO captions JSON: caption its images instead")
    parser.add_argument("--image-dir", help="the images of --coco-annotations")
    parser.add_argument("--beam", type=int, default=None, help="beam size (default: the checkpoint's)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default="results.json", help="results JSON to write (default results.json)")
    add_bad_image_option(parser)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args(argv)
    if bool(options.coco_annotations) != bool(options.image_dir):
        parser.error("--coco-annotations and --image-dir go together")
    if not options.inputs and not options.coco_annotations:
        parser.error("give image files or folders, or --coco-annotations with --image-dir")
    if options.beam is not None and options.beam < 1:
        parser.error("--beam must be at least 1")
    inputs = expand_inputs(options.inputs) if options.inputs else []
    if options.coco_annotations:
        inputs += coco_inputs(options.coco_annotations, options.image_dir)
    module = load_captioner(options.ckpt, device=options.device)
    records, bad_images = [], BadImageCounter()
    for record in caption_files(module, inputs, beam_size=options.beam, batch_size=options.batch_size,
                               on_bad_image=options.on_bad_image, bad_images=bad_images):
        print(f"{record['file_name']}: {record['caption']}")
        records.append(record)
    print(f"wrote {len(records)} captions with attention to {write_json_atomically(options.out, records)}"
          f"{bad_images.skipped_note()}")


def overlay_command(argv: Sequence[str]) -> None:
    import json

    from vision_attn.checkpoint import CheckpointError, checkpoint_kind, load_file
    from vision_attn.data.images import BadImageCounter, expand_inputs, load_or_skip, open_image
    from vision_attn.overlay import save_png, write_gallery

    parser = argparse.ArgumentParser(
        prog="vision-attn overlay",
        description="Draw attention over images: per word for a captioner (or a `caption` results JSON), "
        "rollout and last-layer heads for a ViT. Writes one PNG per image and an index.html gallery.",
    )
    parser.add_argument("inputs", nargs="+", help="image files, folders of images, or results JSON from `caption`")
    parser.add_argument("--ckpt", help="captioner or ViT checkpoint (not needed when every input is a results JSON)")
    parser.add_argument("--out", required=True, help="output folder for the PNGs and index.html")
    parser.add_argument("--beam", type=int, default=None, help="captioner beam size (default: the checkpoint's)")
    parser.add_argument("--upsample", choices=["bilinear", "pyramid"], default="bilinear",
                        help="how the attention grid is enlarged to the image (default bilinear)")
    parser.add_argument("--sigma", type=float, default=None,
                        help="Gaussian smoothing in output pixels (default: a quarter of a grid cell)")
    parser.add_argument("--cmap", default="turbo", help="matplotlib colour map (default turbo)")
    parser.add_argument("--opacity", type=float, default=0.6, help="blend opacity at the strongest attention")
    parser.add_argument("--panel-size", type=int, default=224, help="longer side of each panel in pixels")
    parser.add_argument("--columns", type=int, default=5, help="panels per row before wrapping (default 5)")
    add_rollout_options(parser)
    parser.add_argument("--gradient-class", help="ViT: also draw gradient rollout for this class (name or index)")
    parser.add_argument("--batch-size", type=int, default=32)
    add_bad_image_option(parser)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args(argv)
    if options.panel_size < 16:
        parser.error("--panel-size must be at least 16")
    if options.columns < 1:
        parser.error("--columns must be at least 1")
    bad_images = BadImageCounter()
    policy = {"on_bad_image": options.on_bad_image, "bad_images": bad_images}
    style = {"mode": options.upsample, "sigma": options.sigma, "cmap": options.cmap, "opacity": options.opacity}
    layout = {"panel_size": options.panel_size, "columns": options.columns}
    out = Path(options.out)
    json_inputs = [Path(item) for item in options.inputs if item.lower().endswith(".json")]
    image_inputs = [item for item in options.inputs if not item.lower().endswith(".json")]
    written: list[tuple[str, str]] = []
    used_names: set[str] = set()

    def save(source: str, figure, text: str) -> None:  # noqa: ANN001 - a PIL image
        name = f"{Path(source).stem or 'image'}.png"
        counter = 2
        while name in used_names:
            name, counter = f"{Path(source).stem}_{counter}.png", counter + 1
        used_names.add(name)
        save_png(figure, out / name)
        written.append((name, text))
        print(f"{source}: {text} -> {out / name}")

    records = []
    for results in json_inputs:
        if not results.is_file():
            raise FileNotFoundError(f"{results}: no such results JSON")
        try:
            loaded = json.loads(results.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{results}: not valid JSON ({error})") from None
        if not isinstance(loaded, list) or not all(isinstance(record, dict) for record in loaded):
            raise ValueError(f"{results}: expected a list of caption records (SPEC §4), as `caption` writes")
        for record in loaded:
            name = str(record.get("file_name") or "")
            path = Path(name) if Path(name).is_file() else results.parent / name
            if not name or not path.is_file():
                raise FileNotFoundError(f"{results}: image {name!r} of record {record.get('image_id')!r} not found "
                                        f"(looked in the working directory and in {results.parent})")
            records.append((record, path))

    if image_inputs:
        if not options.ckpt:
            parser.error("--ckpt is needed to overlay image files (only results JSON can go without)")
        loaded_checkpoint = load_file(options.ckpt)
        kind = checkpoint_kind(loaded_checkpoint)
        if kind not in ("vit", "captioner"):
            raise CheckpointError(f"{options.ckpt}: not a checkpoint written by `vision-attn fit` (no model kind)")
        if kind == "vit":
            from vision_attn.vit.inference import class_index, load_classifier, vit_overlays

            module = load_classifier(options.ckpt, device=options.device, loaded=loaded_checkpoint)
            gradient_class = class_index(module, options.gradient_class) if options.gradient_class else None
            paths = [path for _, path in expand_inputs(image_inputs)]
            for source, figure, text in vit_overlays(
                module, paths, head_fusion=options.head_fusion, discard_ratio=options.discard_ratio,
                gradient_class=gradient_class, batch_size=options.batch_size, **policy, **layout, **style,
            ):
                save(source, figure, text)
        else:
            from vision_attn.captioning.inference import caption_files, load_captioner

            if options.gradient_class:
                parser.error("--gradient-class is for ViT checkpoints")
            module = load_captioner(options.ckpt, device=options.device, loaded=loaded_checkpoint)
            captioned = caption_files(module, expand_inputs(image_inputs), beam_size=options.beam,
                                      batch_size=options.batch_size, **policy)
            records += [(record, Path(record["file_name"])) for record in captioned]

    if records:
        from vision_attn.overlay import caption_overlay

        for record, path in records:
            image = load_or_skip(lambda path=path: open_image(path, mode="RGB", max_side=2 * options.panel_size),
                                 options.on_bad_image, bad_images)
            if image is not None:
                save(str(path), caption_overlay(image, record, **layout, **style), record.get("caption", ""))
    print(f"wrote {len(written)} overlays and {write_gallery(out, written)}{bad_images.skipped_note()}")


def rollout_mass_command(argv: Sequence[str]) -> None:
    from vision_attn.data.fashion_mnist import find_fashion_mnist, load_fashion_mnist
    from vision_attn.vit.inference import load_classifier, rollout_on_canvas

    parser = argparse.ArgumentParser(
        prog="vision-attn rollout-mass",
        description="Does the ViT look at the garment? Fashion-MNIST test items pasted at random on a larger "
        "black canvas: accuracy, and the rollout mass on the item's pixels (SPEC §5) against its area share.",
    )
    parser.add_argument("--ckpt", required=True, help="Fashion-MNIST ViT checkpoint")
    parser.add_argument("--canvas-size", type=int, default=56, help="canvas side in pixels (default 56)")
    parser.add_argument("--count", type=int, default=1000, help="test items to use (default 1000)")
    add_rollout_options(parser)
    parser.add_argument("--root", default="data/fashion_mnist", help="where to look after the system location")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args(argv)
    if options.canvas_size < 28:
        parser.error("--canvas-size must be at least 28")
    if options.count < 1:
        parser.error("--count must be at least 1")
    module = load_classifier(options.ckpt, device=options.device)
    images, labels = load_fashion_mnist(find_fashion_mnist(options.root), "test")
    figures = rollout_on_canvas(module, images[: options.count], labels[: options.count],
                                canvas_size=options.canvas_size, seed=options.seed, head_fusion=options.head_fusion,
                                discard_ratio=options.discard_ratio)
    print(f"{int(figures['images'])} Fashion-MNIST test items on {options.canvas_size}x{options.canvas_size} canvases")
    print(f"  accuracy                      {figures['accuracy']:.2%}")
    print(f"  rollout mass on the item      {figures['rollout_mass_in_mask']:.3f}")
    print(f"  item's area (a blind map)     {figures['mask_area_share']:.3f}")


def benchmark_command(argv: Sequence[str]) -> None:
    from vision_attn.benchmark import main as benchmark_main

    benchmark_main(list(argv))


TOOLS: dict[str, tuple[Callable[[Sequence[str]], None], str]] = {
    "classify": (classify_command, "top-k classes of images with a trained ViT"),
    "caption": (caption_command, "caption images with a trained captioner; results JSON with attention"),
    "export-samples": (export_samples_command, "write dataset images as PNG files (for classify and overlay)"),
    "make-scenes": (make_scenes_command, "generate the Fashion scenes captioning dataset"),
    "overlay": (overlay_command, "attention over images: per word (captioner) or rollout and heads (ViT)"),
    "rollout-mass": (rollout_mass_command, "ViT: rollout mass on Fashion-MNIST items placed on a larger canvas"),
    "benchmark": (benchmark_command, "measured speed side by side (markdown table + JSON)"),
}
LIGHTNING_COMMANDS = {
    "fit": "train a model (--config configs/...yaml)",
    "validate": "run the validation loop",
    "test": "run the test loop (--ckpt_path C)",
    "predict": "run prediction",
}


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
    from vision_attn.errors import exit_on_user_error

    with exit_on_user_error():
        if argv[0] in TOOLS:
            TOOLS[argv[0]][0](argv[1:])
        else:
            run_lightning(argv if args is not None else None)


if __name__ == "__main__":
    main()
