"""scripts/variants.py: the overrides it applies and the run folder it moves a config to."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "variants.py"


@pytest.fixture(scope="module")
def variants():
    spec = importlib.util.spec_from_file_location("variants_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config() -> dict:
    return {"seed_everything": 0,
            "trainer": {"max_time": "00:00:10:00", "default_root_dir": "runs/a",
                        "callbacks": [{"init_args": {"dirpath": "runs/a/checkpoints"}}]},
            "model": {"init_args": {"architecture": {"embed_dim": 96}}},
            "data": {"init_args": {"root": "data/x", "canvas": {"train_window": None}}}}


def test_each_kind_of_override_lands_where_it_names(variants) -> None:
    cfg = config()
    done = variants.apply_sets(cfg, ["architecture.embed_dim=64", "data.canvas.train_window=40",
                                     "trainer.max_time=00:00:01:00", "seed_everything=1",
                                     "model.training.attention_grounding=1.0"])
    assert cfg["model"]["init_args"] == {"architecture": {"embed_dim": 64}, "training": {"attention_grounding": 1.0}}
    assert cfg["data"]["init_args"]["canvas"]["train_window"] == 40
    assert cfg["trainer"]["max_time"] == "00:00:01:00"
    assert cfg["seed_everything"] == 1
    assert done["seed_everything"] == 1 and done["architecture.embed_dim"] == 64


@pytest.mark.parametrize("pair", ["embed_dim", "=3", "model.=2", "decoder..dropout=0.1"])
def test_a_malformed_override_stops_with_a_message(variants, pair: str) -> None:
    with pytest.raises(ValueError, match="--set"):
        variants.apply_sets(config(), [pair])


@pytest.mark.parametrize(("args", "message"), [
    (["bad/name"], "NAME must be"),
    (["fine", "--config", "configs/none.yaml"], "no such config"),
    (["fine", "--config", "configs/vit/fashion_mnist.yaml", "--set", "model.=1"], "--set KEY is"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert not (SCRIPT.parents[1] / "runs" / "fine.yaml").exists()


def test_every_path_under_the_run_folder_moves(variants) -> None:
    moved = variants.move_run(config(), "runs/a", "runs/b")
    assert moved["trainer"]["default_root_dir"] == "runs/b"
    assert moved["trainer"]["callbacks"][0]["init_args"]["dirpath"] == "runs/b/checkpoints"
    assert moved["data"]["init_args"]["root"] == "data/x"
