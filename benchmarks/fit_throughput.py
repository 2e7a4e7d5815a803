"""A whole ``vision-attn fit`` of the COCO recipe, timed: ``python -m benchmarks.fit_throughput``.

The isolated train step of ``benchmarks/device.py`` leaves out what a real epoch also does: the loader reading the
feature cache, captions of every length in grouped batches, the optimiser, logging, validation's beam search and
the checkpoint. This runs the real command (``configs/captioner/coco_vgg19.yaml`` on ``configs/trainer/gpu.yaml``,
through the console entry point) on a COCO-shaped Karpathy dataset it writes first: 224-px JPEGs, 5 captions an
image (some 6 or 7, as in COCO) of 8 to 22 words from a 10,000-word list, so that the vocabulary, the caption
lengths and the grouped batches have COCO's shapes. The encoder is randomly initialised (no ImageNet weights are
needed), the feature cache is filled by the first run and read by the others.

Each variant (eager or ``decoder.compile`` mode, and precision) fits ``--epochs`` epochs; ``StepClock``, a callback
added on the command line, times every step. The figures are over the epochs after the first (compiling,
CUDA-graph capture and the cache's first reads fall in the first): sustained training captions/s over the whole
loop (steps, loader waits, the epoch's end, validation), the share of that time spent waiting for the loader, the
validation time per 125 images, and the projected epoch of COCO's Karpathy training split (113,287 images,
566,747 captions) with its 5,000-image validation.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.device import cpu_description
from benchmarks.run import markdown_table
from vision_attn.cli_arguments import OneLineParser, at_least
from vision_attn.errors import exit_on_user_error
from vision_attn.io import output_file, write_json_atomically

COCO_TRAIN_IMAGES, COCO_TRAIN_CAPTIONS, COCO_VAL_IMAGES = 113_287, 566_747, 5_000  # Karpathy train + restval, val
WORDS = 10_000
RECIPE = ("configs/trainer/gpu.yaml", "configs/tasks/captioner.yaml", "configs/data/coco.yaml",
          "configs/captioner/coco_vgg19.yaml")
VARIANTS = {  # name: (decoder.compile, precision)
    "compiled reduce-overhead bf16-mixed": ("reduce-overhead", "bf16-mixed"),
    "eager bf16-mixed": (None, "bf16-mixed"),
    "compiled reduce-overhead 32-true": ("reduce-overhead", "32-true"),
    "eager 32-true": (None, "32-true"),
    "compiled default bf16-mixed": ("default", "bf16-mixed"),
}


class StepClock(L.Callback):
    """Times a fit into ``out`` (JSON) when it ends: each epoch's span and each validation's, on a GPU between
    synchronisations (so that queued work is counted where it ran), and per step its epoch, its captions and how
    long the loop waited for its batch (from the previous step's end, or the epoch's start, to this step's start,
    on the host's clock: steps are not synchronised, so that the loader and the GPU overlap as in any fit)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[dict[str, float]] = []
        self.epochs: list[dict[str, float]] = []
        self.validations: list[dict[str, float]] = []
        self._last_end = 0.0

    def _now(self, trainer: L.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = self._last_end = self._now(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        self.steps.append({"epoch": trainer.current_epoch, "captions": 0 if batch is None else len(batch.captions),
                           "wait": now - self._last_end})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._last_end = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_start = self._now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        end = self._now(trainer)
        self.validations.append({"epoch": trainer.current_epoch, "seconds": end - self._validation_start,
                                 "sanity": trainer.sanity_checking})
        self._last_end = end  # the next step's wait is the loader's, not validation's

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epochs.append({"epoch": trainer.current_epoch, "seconds": self._now(trainer) - self._epoch_start})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            write_json_atomically(self.out, {"steps": self.steps, "epochs": self.epochs,
                                             "validations": self.validations})


def write_coco_shaped(root: Path, *, train: int, val: int, seed: int = 0) -> dict[str, int]:
    """A Karpathy-format COCO under ``root``: ``train`` training and ``val`` validation images (224-px JPEGs: a
    smooth random background and a block of colour), 2 test images, captions as described above; returns the
    counts written."""
    from PIL import Image

    rng = random.Random(seed)
    words = [f"w{index:04d}" for index in range(WORDS)]
    (root / "train2014").mkdir(parents=True, exist_ok=True)
    (root / "val2014").mkdir(exist_ok=True)
    entries, captions = [], 0
    for index in range(train + val + 2):
        split, folder = ("train", "train2014") if index < train else (
            ("val" if index < train + val else "test"), "val2014")
        name = f"COCO_{folder}_{index:012d}.jpg"
        noise = torch.randint(0, 256, (28, 28, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(index))
        image = Image.fromarray(noise.numpy()).resize((224, 224), Image.Resampling.BILINEAR)
        left, top = rng.randrange(150), rng.randrange(150)
        image.paste(tuple(rng.randrange(256) for _ in range(3)), (left, top, left + 74, top + 74))
        image.save(root / folder / name, quality=90)
        count = rng.choices((5, 6, 7), weights=(90, 8, 2))[0]
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 22))) for _ in range(count)]
        captions += count if split == "train" else 0
        entries.append({"filepath": folder, "filename": name, "split": split, "cocoid": index + 1,
                        "imgid": index, "sentences": [{"raw": s, "tokens": s.split()} for s in sentences]})
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries, "dataset": "coco"}))
    return {"train_images": train, "train_captions": captions, "val_images": val}


def fit_command(data: Path, run: Path, clock: Path, *, compile_mode: str | None, precision: str, epochs: int,
                accelerator: str, workers: int, batch_size: int, eval_batch_size: int,
                min_word_count: int) -> list[str]:
    """The recipe's ``vision-attn fit``, with the sizes, paths, variant and the clock overridden."""
    configs = [part for config in RECIPE for part in ("--config", config)]
    callback = {"class_path": "benchmarks.fit_throughput.StepClock", "init_args": {"out": str(clock)}}
    return [sys.executable, "-c", "from vision_attn.cli import main; main()", "fit", *configs,
            "--model.init_args.encoder.pretrained", "null",
            "--model.init_args.decoder.compile", "null" if compile_mode is None else compile_mode,
            "--data.init_args.vocabulary.min_word_count", str(min_word_count),
            "--trainer.accelerator", accelerator, "--trainer.precision", precision,
            "--trainer.max_epochs", str(epochs), "--trainer.limit_val_batches", "1",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(run), "--trainer.logger.init_args.save_dir", str(run),
            f"--trainer.callbacks+={json.dumps(callback)}",
            "--data.init_args.root", str(data), "--data.init_args.feature_cache.folder", str(data / "feature_cache"),
            "--data.init_args.loader.num_workers", str(workers),
            "--data.init_args.loader.batch_size", str(batch_size),
            "--data.init_args.loader.eval_batch_size", str(eval_batch_size)]


def sustained(clock: dict[str, Any], *, val_images: int) -> dict[str, float]:
    """The figures of one fit's clock over its epochs after the first: training time is the epochs' spans less
    their validations."""
    later = [epoch for epoch in clock["epochs"] if epoch["epoch"] >= 1]
    if not later:
        raise ValueError("the fit ran no epoch after its first: give --epochs 2 or more")
    validations = [v for v in clock["validations"] if not v["sanity"]]
    later_validations = [v["seconds"] for v in validations if v["epoch"] >= 1]
    training = sum(epoch["seconds"] for epoch in later) - sum(later_validations)
    steps = [step for step in clock["steps"] if step["epoch"] >= 1]
    captions = sum(step["captions"] for step in steps)
    rate = captions / training
    per_image = (statistics.median(later_validations) if later_validations else float("nan")) / val_images
    first = clock["epochs"][0]["seconds"]
    return {"steps": len(steps), "captions": captions, "captions_per_s": rate,
            "captions_per_step": captions / len(steps), "mean_step_s": training / len(steps),
            "loader_share": sum(step["wait"] for step in steps) / training,
            "validation_s_per_image": per_image, "first_epoch_s": first,
            "coco_epoch_min": (COCO_TRAIN_CAPTIONS / rate + COCO_VAL_IMAGES * per_image) / 60}


def table(results: dict[str, Any]) -> str:
    rows = [("machine", f"{results['machine']['device']} (torch {results['machine']['torch']})", ""),
            ("data", f"{results['data']['train_images']} training images, {results['data']['train_captions']} "
                     f"captions; {results['data']['val_images']} validation images; {results['epochs']} epochs, "
                     f"figures over epochs 2 to {results['epochs']}", "")]
    for name, figures in results["variants"].items():
        if "error" in figures:
            rows.append((name, f"failed: {figures['error']}", ""))
            continue
        rows.append((name, f"{figures['captions_per_s']:,.0f} captions/s ({figures['captions_per_step']:.1f} a step, "
                           f"mean step {figures['mean_step_s'] * 1e3:.1f} ms); waiting for the loader "
                           f"{figures['loader_share']:.0%} of the time; validation "
                           f"{figures['validation_s_per_image'] * 1e3:.2f} ms an image; first epoch (compiling) "
                           f"{figures['first_epoch_s']:.0f} s",
                     f"COCO epoch {figures['coco_epoch_min']:.1f} min"))
    return markdown_table(rows)


def main(argv: list[str] | None = None) -> None:
    """Parse, write the data, fit each variant, print the table, write JSON."""
    parser = OneLineParser(prog="python -m benchmarks.fit_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="what to fit (default all)")
    parser.add_argument("--train-images", type=at_least(2, 200_000), default=2600, help="default 2600 (200 steps "
                                                                                       "an epoch at 13 images)")
    parser.add_argument("--val-images", type=at_least(1, 10_000), default=125, help="default 125 (one batch)")
    parser.add_argument("--epochs", type=at_least(2, 100), default=3, help="default 3; the first is warm-up")
    parser.add_argument("--batch-size", type=at_least(1, 4096), default=13, help="images a step (the recipe's 13)")
    parser.add_argument("--workers", type=at_least(0, 64), default=8, help="loader workers (the recipe's 8)")
    parser.add_argument("--min-word-count", type=at_least(1, 1000), default=5,
                        help="the vocabulary's (the recipe's 5; a small --train-images needs 1)")
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu", help="default gpu")
    parser.add_argument("--work", type=Path, default=None, help="where the data and runs go (default: a temporary "
                                                                "folder, deleted)")
    parser.add_argument("--out", default="fit_throughput.json", help="the JSON written (default fit_throughput.json)")
    options = parser.parse_args(argv)
    with exit_on_user_error():
        out = output_file(options.out)
        if options.accelerator == "gpu" and not torch.cuda.is_available():
            raise ValueError("--accelerator gpu: torch sees no CUDA GPU here; give --accelerator cpu")
        with tempfile.TemporaryDirectory(prefix="fit_throughput_") as temporary:
            work = options.work or Path(temporary)
            started = time.perf_counter()
            data = write_coco_shaped(work / "coco", train=options.train_images, val=options.val_images)
            print(f"wrote the data in {time.perf_counter() - started:.0f} s: {data}", flush=True)
            device = torch.cuda.get_device_name(0) if options.accelerator == "gpu" else cpu_description()
            results: dict[str, Any] = {"machine": {"device": device, "torch": torch.__version__,
                                                   "date": time.strftime("%Y-%m-%d")},
                                       "data": data, "epochs": options.epochs, "variants": {}}
            for name in options.variants:
                compile_mode, precision = VARIANTS[name]
                slug = name.replace(" ", "_")
                clock = work / f"{slug}.json"
                command = fit_command(work / "coco", work / slug, clock, compile_mode=compile_mode,
                                      precision=precision, epochs=options.epochs, accelerator=options.accelerator,
                                      workers=options.workers, batch_size=options.batch_size,
                                      eval_batch_size=min(125, options.val_images),
                                      min_word_count=options.min_word_count)
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
                print(f"{name}: exit {done.returncode} in {time.perf_counter() - started:.0f} s", flush=True)
                notes = [line for line in done.stderr.splitlines()
                         if re.search(r"(?i)recompil|cudagraph|graph break|skipping", line)]
                print("\n".join(notes[:8]), flush=True)  # what the compiler said of the shapes, if anything
                if done.returncode or not clock.exists():
                    tail = " | ".join(done.stderr.strip().splitlines()[-3:])
                    results["variants"][name] = {"error": tail[-400:] or f"exit {done.returncode}"}
                    print(done.stderr[-3000:], file=sys.stderr)
                else:
                    results["variants"][name] = sustained(json.loads(clock.read_text()),
                                                          val_images=options.val_images)
                results["table"] = table(results)  # after each variant: a time limit keeps what was measured
                write_json_atomically(out, results)
        print(results["table"])
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
