"""Train and score a variant of a config under its own budget, for side-by-side tables.

    python scripts/variants.py NAME [--config CONFIG ...] [--set KEY=VALUE ...]

The CONFIGs are composed as `vision-attn fit` composes them (default: the Fashion scenes captioner,
configs/trainer/cpu.yaml, configs/tasks/captioner.yaml and configs/captioner/fashion_scenes.yaml). NAME is the run's
folder under runs/: every path of the config under its own run folder moves there. Each ``--set`` overrides one
option; KEY is ``model.X``, ``data.X``, ``trainer.X`` or ``seed_everything``, or a bare ``X`` for ``model.X``, X a
dotted path into the option groups (the value is read as YAML: ``--set decoder.attention_score=dot``,
``--set data.canvas.train_window=40``). The script writes the whole config to runs/NAME.yaml, then runs through
the console script what ``make demo`` runs for a default:

- ``fit`` and ``test``;
- a captioner: ``caption`` + ``evaluate`` on 1000 test scenes with items anywhere and other shades
  (``--layout free --shade-jitter 1``) and on the same default test scenes tinted by other makers' palettes
  (``--palette css|tab10|dark|pale``), each made once under data/; one JSON line per set of scenes with pointing,
  the scene metrics, BLEU-4 and CIDEr-D;
- a ViT on Fashion-MNIST canvases: ``rollout-mass`` (each map's mass on the item and its pointing game).

Each JSON line also gives the optimiser steps the budget gave. A captioner that keeps the default's
``encoder.pretrained`` needs the encoder pretraining (configs/captioner/fashion_scene_items.yaml) first. Run it
alone or beside other jobs: the budgets are in steps, so load moves a run's time, not its figures. The thread
count changes the rounding, and so the figures, by about as much as a seed: compare runs at one count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCENES_CONFIGS = ["configs/trainer/cpu.yaml", "configs/tasks/captioner.yaml", "configs/captioner/fashion_scenes.yaml"]
SHIFTED_SCENES = {  # folder under data/ -> the make-scenes options that draw it (test split only)
    "fashion_scenes_free": ["--layout", "free", "--shade-jitter", "1"],
    **{f"palette_{name}": ["--palette", name] for name in ("css", "tab10", "dark", "pale")},
}


def move_run(node, old: str, new: str):
    """The config with every path under the run folder ``old`` moved under ``new``."""
    if isinstance(node, dict):
        return {key: move_run(value, old, new) for key, value in node.items()}
    if isinstance(node, list):
        return [move_run(value, old, new) for value in node]
    if isinstance(node, str) and node.startswith(old):
        return new + node[len(old):]
    return node


def apply_sets(config: dict, pairs: list[str]) -> dict:
    """``KEY=VALUE`` overrides: ``model.X`` / ``data.X`` (their init_args), ``trainer.X``, ``seed_everything``,
    or a bare ``X`` (model); X may be a dotted path into a group (``decoder.attention_score``)."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set needs KEY=VALUE, got {pair!r}")
        if key == "seed_everything":
            config[key] = overrides[key] = yaml.safe_load(value)
            continue
        section, dot, option = key.partition(".")
        if section not in ("model", "data", "trainer"):
            section, option = "model", key
        if not option or "" in option.split("."):
            raise ValueError(f"--set KEY is model.X, data.X, trainer.X, seed_everything or X, got {key!r}")
        target = config[section] if section == "trainer" else config[section].setdefault("init_args", {})
        *groups, name = option.split(".")
        for group in groups:
            target = target.setdefault(group, {})
        target[name] = overrides[key] = yaml.safe_load(value)
    return overrides


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT)


def flat_scores(path: Path) -> dict:
    flat: dict = {}
    for key, value in json.loads(path.read_text(encoding="utf-8")).items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return {key: round(value, 4) for key, value in flat.items() if isinstance(value, (int, float))}


def score_captioner(cli: str, run_dir: str, test_root: str, steps: int | None, header: dict) -> None:
    """``evaluate`` on the test split, then ``caption`` + ``evaluate`` on each set of shifted scenes."""
    sets = [("test", test_root, f"{run_dir}/results_test.json")]
    for folder, options in SHIFTED_SCENES.items():
        root = f"data/{folder}"
        if not (ROOT / root / "annotations" / "captions_test.json").exists():
            run(cli, "make-scenes", "--root", root, "--train", "0", "--val", "0", "--test", "1000", *options)
        results = f"{run_dir}/results_{folder}.json"
        run(cli, "caption", "--ckpt", f"{run_dir}/checkpoints/best.ckpt", "--coco-annotations",
            f"{root}/annotations/captions_test.json", "--image-dir", f"{root}/images/test", "--out", results)
        sets.append((folder, root, results))
    for name, root, results in sets:
        out = f"{run_dir}/scores_{name}.json"
        run(cli, "evaluate", results, "--annotations", f"{root}/annotations/captions_test.json",
            "--instances", f"{root}/annotations/instances_test.json",
            "--attributes", f"{root}/annotations/attributes_test.json", "--out", out)
        print(json.dumps({**header, "scenes": name, "steps": steps, **flat_scores(ROOT / out)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--config", dest="configs", action="append", metavar="CONFIG",
                        help="a config to compose, in order (default: the Fashion scenes captioner's)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not args.name.replace("_", "").replace("-", "").isalnum():
        parser.error(f"NAME must be letters, digits, - and _: got {args.name!r}")
    try:
        apply_sets({"model": {}, "data": {}, "trainer": {}}, args.sets)  # the keys' form, before any work
    except ValueError as error:
        parser.error(str(error))
    configs = args.configs or SCENES_CONFIGS
    for name in configs:
        if not (ROOT / name).is_file():
            parser.error(f"{name}: no such config")
    cli = str(Path(sys.executable).parent / "vision-attn")
    composed = subprocess.run([cli, "fit", *(arg for name in configs for arg in ("--config", name)), "--print_config"],
                              cwd=ROOT, capture_output=True, text=True)
    if composed.returncode:
        parser.error(f"the configs do not compose: {composed.stderr.strip().splitlines()[-1]}")
    config = yaml.safe_load(composed.stdout)
    run_dir = f"runs/{args.name}"
    config = move_run(config, config["trainer"]["default_root_dir"], run_dir)
    try:
        overrides = apply_sets(config, args.sets)
    except ValueError as error:
        parser.error(str(error))
    config_path = ROOT / "runs" / f"{args.name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    ckpt = f"{run_dir}/checkpoints/best.ckpt"
    run(cli, "fit", "--config", str(config_path), "--overwrite", "true")
    run(cli, "test", "--config", str(config_path), "--ckpt_path", ckpt)
    steps = torch.load(ROOT / run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False).get("global_step")
    header = {"run": args.name, **overrides}
    if config["model"]["class_path"].endswith("CaptionerTask"):
        score_captioner(cli, run_dir, config["data"]["init_args"]["root"], steps, header)
    elif config["data"]["class_path"].endswith("FashionMNISTCanvasDataModule"):
        run(cli, "rollout-mass", "--ckpt", ckpt)
        print(json.dumps({**header, "steps": steps}), flush=True)
    else:
        print(json.dumps({**header, "steps": steps}), flush=True)


if __name__ == "__main__":
    main()
