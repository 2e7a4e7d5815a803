"""Refusals only where data is really wrong: a command that reads some splits of a Fashion scenes root checks only
those splits' styles, and names the split and the fields that differ; `evaluate` takes what `caption` writes for
the files of a split, matched to the split's annotations by file name."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_in_process, tiny


def one_line_error(done) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback)."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines and lines[-1].startswith("error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[-1]


def test_a_command_checks_the_style_of_only_the_splits_it_reads(trained_captioner, tmp_path) -> None:
    """The session captioner's scenes are all in the default style; a config that asks for its training scenes
    drawn freely still tests, validates and predicts with a checkpoint (those read the val or test split), and
    fit is refused in one line naming the split and the one field, never advising to delete the data."""
    root, ckpt = trained_captioner["scenes"], trained_captioner["ckpt"]
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(root),
              "--data.init_args.scenes.styles", "{train: {layout: free}}"]
    for command, limit in (("test", "limit_test_batches"), ("validate", "limit_val_batches"),
                           ("predict", "limit_predict_batches")):
        done = run_in_process(command, *common, "--ckpt_path", str(ckpt), f"--trainer.{limit}", "1",
                              "--trainer.default_root_dir", str(tmp_path / command))
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    error = one_line_error(run_in_process("fit", *common, "--trainer.default_root_dir", str(tmp_path / "fit")))
    assert error == (f"error: {root / 'annotations' / 'captions_train.json'}: the train scenes were drawn with "
                     "layout grid, but data.init_args.scenes.styles asks for layout free; ask for the style they were "
                     "drawn in, or point data.init_args.root at scenes drawn as asked")
    assert "delete" not in error and not (tmp_path / "fit" / "checkpoints").exists()
    done = run_in_process("test", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(root),
                          "--data.init_args.scenes.styles", "{test: {shade_jitter: 1.0, objects: [1, 5]}}",
                          "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(tmp_path / "test_split"))
    assert one_line_error(done).endswith("captions_test.json: the test scenes were drawn with shade_jitter 0.0, "
                                         "objects [2, 3], but data.init_args.scenes.styles asks for shade_jitter "
                                         "1.0, objects [1, 5]; ask for the style they were drawn in, or point "
                                         "data.init_args.root at scenes drawn as asked")
