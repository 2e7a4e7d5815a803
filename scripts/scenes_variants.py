"""Train and score a variant of the Fashion scenes captioner under the default's own budget, for side-by-side tables.

    python scripts/scenes_variants.py NAME [--set KEY=VALUE ...] [--free-root data/fashion_scenes_free]

NAME is the run's folder under runs/. Each ``--set`` overrides one of configs/captioner/fashion_scenes.yaml's
``model.init_args`` (the value is read as YAML: ``--set attention_score=dot``, ``--set trainable_stages=0``).
Everything else is the default's: data, losses, the 9.5-minute budget and its schedule. The script writes
runs/NAME.yaml, then runs, through the console script, what ``make demo`` runs for the default:
``fit``, ``test`` (SPEC §3 scenes), and ``caption`` + ``evaluate`` on the free-layout, shade-jittered test scenes
(made once by ``make-scenes``), and prints one JSON line per split with pointing, the scene metrics, BLEU-4,
CIDEr-D and the number of optimiser steps the budget gave. The encoder pretraining
(configs/captioner/fashion_scene_items.yaml) must have run first when the variant keeps the default's
``pretrained_encoder``. Run it on an otherwise idle machine: the budget is wall time.
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
DEFAULT = ROOT / "configs" / "captioner" / "fashion_scenes.yaml"
DEFAULT_RUN = "runs/captioner_fashion_scenes"
TEST_ROOT = "data/fashion_scenes_varied"


def replace_run(node, run: str):
    if isinstance(node, dict):
        return {key: replace_run(value, run) for key, value in node.items()}
    if isinstance(node, list):
        return [replace_run(value, run) for value in node]
    if isinstance(node, str) and node.startswith(DEFAULT_RUN):
        return run + node[len(DEFAULT_RUN):]
    return node


def parse_sets(pairs: list[str]) -> dict:
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            sys.exit(f"--set needs KEY=VALUE, got {pair!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


def run(*args: str) -> None:
    print("$", " ".join(args), flush=True)
    subprocess.run(args, check=True, cwd=ROOT)


def row(scores_path: Path) -> dict:
    flat = {}
    for key, value in json.loads(scores_path.read_text(encoding="utf-8")).items():
        flat.update(value) if isinstance(value, dict) else flat.__setitem__(key, value)
    return {key: round(value, 4) for key, value in flat.items() if isinstance(value, (int, float))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--free-root", default="data/fashion_scenes_free")
    args = parser.parse_args()
    if not args.name.replace("_", "").replace("-", "").isalnum():
        sys.exit(f"NAME must be letters, digits, - and _: got {args.name!r}")
    overrides = parse_sets(args.sets)
    config = yaml.safe_load(DEFAULT.read_text(encoding="utf-8"))
    run_dir = f"runs/{args.name}"
    config = replace_run(config, run_dir)
    config["model"]["init_args"].update(overrides)
    config_path = ROOT / "runs" / f"{args.name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")

    cli = str(Path(sys.executable).parent / "vision-attn")
    run(cli, "fit", "--config", str(config_path), "--overwrite", "true")
    ckpt = f"{run_dir}/checkpoints/best.ckpt"
    run(cli, "test", "--config", str(config_path), "--ckpt_path", ckpt)
    free = args.free_root
    if not (ROOT / free / "annotations" / "captions_test.json").exists():
        run(cli, "make-scenes", "--root", free, "--train", "0", "--val", "0", "--test", "1000",
            "--layout", "free", "--shade-jitter", "1")
    run(cli, "caption", "--ckpt", ckpt, "--coco-annotations", f"{free}/annotations/captions_test.json",
        "--image-dir", f"{free}/images/test", "--out", f"{run_dir}/results_free_test.json")
    for split, root, results in (("test", TEST_ROOT, f"{run_dir}/results_test.json"),
                                 ("free", free, f"{run_dir}/results_free_test.json")):
        out = f"{run_dir}/scores_{split}.json"
        run(cli, "evaluate", results, "--annotations", f"{root}/annotations/captions_test.json",
            "--instances", f"{root}/annotations/instances_test.json",
            "--attributes", f"{root}/annotations/attributes_test.json", "--out", out)
        steps = torch.load(ROOT / run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                           weights_only=False).get("global_step")
        print(json.dumps({"run": args.name, "split": split, "steps": steps, **overrides, **row(ROOT / out)}),
              flush=True)


if __name__ == "__main__":
    main()
