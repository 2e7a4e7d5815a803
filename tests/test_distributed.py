"""Two CPU processes (gloo) through the real console script give what one process gives."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_in_process, run_script, tiny

DDP = ("--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu")


def printed_metrics(stdout: str, stage: str) -> dict[str, str]:
    """Lightning's end-of-run metrics table (plain or rich), as printed."""
    return dict(re.findall(rf"^[\s│|]*({stage}/[\w\-]+)[\s│|]+([-\d.e+]+)[\s│|]*$", stdout, flags=re.MULTILINE))


def test_vit_accuracy_with_two_processes_equals_one_on_an_odd_sized_split(vit_checkpoint, tmp_path) -> None:
    # 999 validation images: shards of 500 and 499, so padding (a repeated image) would change the accuracy.
    common = ["validate", *tiny("vit_tiny.yaml"), "--ckpt_path", str(vit_checkpoint),
              "--data.init_args.val_size", "999", "--data.init_args.loader.eval_batch_size", "100",
              "--trainer.limit_val_batches", "1.0"]
    one = run_in_process(*common, "--trainer.default_root_dir", str(tmp_path / "one"))
    two = run_script(*common, *DDP, "--trainer.default_root_dir", str(tmp_path / "two"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    one_metrics, two_metrics = printed_metrics(one.stdout, "val"), printed_metrics(two.stdout, "val")
    assert "val/acc" in one_metrics
    assert one_metrics["val/acc"] == two_metrics["val/acc"]  # exactly, as printed
    assert float(one_metrics["val/loss"]) == pytest.approx(float(two_metrics["val/loss"]), rel=1e-5)


def test_a_two_process_fit_checkpoints_once(tmp_path) -> None:
    run = tmp_path / "run"
    result = run_script("fit", *tiny("vit_tiny.yaml"), *DDP, "--trainer.default_root_dir",
                        str(run))  # one epoch of 4 steps, then validation
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoints = sorted(path.name for path in run.rglob("*.ckpt"))
    assert checkpoints == ["best.ckpt", "last.ckpt"]  # one writer (rank 0): no best-v1.ckpt, no torn copies
    assert not list(run.rglob(".*.tmp"))
