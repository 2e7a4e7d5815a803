"""A trained checkpoint runs anywhere with only the data: copied alone to another folder, away from the files its
fit started from (the captioner's pretrained encoder, a ViT's first weights and teacher), it tests, validates,
predicts, captions, draws overlays and the explorer; `predict` writes what `caption` and `classify` give for the
same images; `--ckpt_path last` with no last checkpoint is refused in one line."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process, run_script, tiny
from vision_attn.checkpoint import load_file
from vision_attn.cli import main

METRIC_ROW = re.compile(r"^\s*((?:test|val)/[\w\-]+)\s+([-\d.e+]+)\s*$", flags=re.MULTILINE)


def printed_metrics(stdout: str) -> dict[str, float]:
    """Lightning's end-of-run metrics table, as printed."""
    return {name: float(value) for name, value in METRIC_ROW.findall(stdout)}


def fails_in_one_line(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    """``vision-attn ARGS`` in this process: exit 2 and one ``error:`` line as the last word, no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-2000:]
    return errors[0]


def ok(result) -> str:
    """The stdout of a command that must succeed."""
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def portable(trained_captioner, tmp_path_factory) -> dict[str, Path]:
    """A tiny captioner fitted from a pretrained encoder named by a relative path (``encoder/start.ckpt``, the
    session captioner's trunk), tested where it was made; then its checkpoint alone is copied to a new folder and
    the encoder file deleted."""
    work = tmp_path_factory.mktemp("made_here")
    (work / "encoder").mkdir()
    shutil.copy(trained_captioner["ckpt"], work / "encoder" / "start.ckpt")
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(trained_captioner["scenes"]),
              "--model.init_args.encoder.pretrained", "encoder/start.ckpt"]
    with contextlib.chdir(work):
        ok(run_in_process("fit", *common, "--trainer.default_root_dir", "run", "--trainer.limit_train_batches", "1"))
        checkpoint = work / "run" / "checkpoints" / "best.ckpt"
        assert load_file(checkpoint)["hyper_parameters"]["encoder"]["pretrained"] == "encoder/start.ckpt"
        here = printed_metrics(ok(run_in_process("test", *common, "--ckpt_path", str(checkpoint),
                                                 "--trainer.default_root_dir", "tested_here")))
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.copy(checkpoint, elsewhere / "model.ckpt")
    shutil.rmtree(work / "encoder")
    return {"copy": elsewhere / "model.ckpt", "folder": elsewhere, "scenes": trained_captioner["scenes"],
            "metrics": here}


def test_a_captioner_copied_alone_tests_validates_and_predicts_without_its_encoder_file(portable, monkeypatch
                                                                                          ) -> None:
    """From another folder, with the config still naming the encoder file (now gone): test gives the metrics it
    gave where it was made, validate runs, and predict writes the test split's captions in the run's folder."""
    monkeypatch.chdir(portable["folder"])
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(portable["scenes"]),
              "--model.init_args.encoder.pretrained", "encoder/start.ckpt",
              "--ckpt_path", str(portable["copy"])]
    tested = printed_metrics(ok(run_in_process("test", *common, "--trainer.default_root_dir", "tested")))
    assert tested == portable["metrics"] and "test/CIDEr-D" in tested
    assert "val/CIDEr-D" in printed_metrics(ok(run_in_process("validate", *common,
                                                              "--trainer.default_root_dir", "validated")))
    predicted = ok(run_in_process("predict", *common, "--trainer.default_root_dir", "predicted"))
    path = portable["folder"] / "predicted" / "predictions.json"
    assert f"wrote 6 predictions to {path}" in predicted
    results = json.loads((portable["folder"] / "tested" / "results_test.json").read_text())
    predictions = json.loads(path.read_text())
    assert [(r["image_id"], r["caption"]) for r in predictions] == [(r["image_id"], r["caption"]) for r in results]


def test_predict_writes_what_caption_writes_and_the_tools_run_from_the_copy(portable, tmp_path) -> None:
    """`caption`, `overlay` and `explore` read the copy alone; `caption` on the test images gives the records
    `predict` wrote for them (the same caption, tokens and attention)."""
    images = portable["scenes"] / "images" / "test"
    ok(run_in_process("predict", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(portable["scenes"]),
                      "--ckpt_path", str(portable["copy"]), "--trainer.default_root_dir", str(tmp_path / "run")))
    predicted = {r["file_name"]: r for r in json.loads((tmp_path / "run" / "predictions.json").read_text())}
    ok(run_in_process("caption", "--ckpt", str(portable["copy"]), str(images), "--out", str(tmp_path / "c.json")))
    captioned = {r["file_name"]: r for r in json.loads((tmp_path / "c.json").read_text())}
    assert sorted(captioned) == sorted(predicted) and len(captioned) == 6
    for name, record in captioned.items():
        theirs = predicted[name]
        assert (record["caption"], record["tokens"], record["grid"]) == \
            (theirs["caption"], theirs["tokens"], theirs["grid"]), name
        assert torch.allclose(torch.tensor(record["alphas"]), torch.tensor(theirs["alphas"]), atol=1e-5), name
    first = sorted(images.glob("*.png"))[0]
    ok(run_in_process("overlay", "--ckpt", str(portable["copy"]), str(first), "--out", str(tmp_path / "ov")))
    assert len(list((tmp_path / "ov").glob("*.png"))) == 1
    ok(run_in_process("explore", "--ckpt", str(portable["copy"]), "--images", str(first),
                      "--out", str(tmp_path / "site")))
    assert (tmp_path / "site" / "index.html").is_file()


def test_load_from_checkpoint_reads_no_initial_weights(portable, vit_copy) -> None:
    """The tasks' ``load_from_checkpoint`` builds the model without the files its fit started from."""
    from vision_attn.tasks import CaptionerTask, ViTTask

    captioner = CaptionerTask.load_from_checkpoint(portable["copy"])
    saved = load_file(portable["copy"])["state_dict"]
    assert torch.equal(captioner.model.encoder.trunk.state_dict()["0.0.weight"],
                       saved["model.encoder.trunk.0.0.weight"])
    assert ViTTask.load_from_checkpoint(vit_copy).hparams["pretrained"] is None


@pytest.fixture
def vit_copy(vit_checkpoint, tmp_path) -> Path:
    """The session ViT's checkpoint alone in a new folder, its hyper-parameters naming first weights and a
    teacher that are not there (as a fit from them on another machine writes them)."""
    checkpoint = load_file(vit_checkpoint)
    checkpoint["hyper_parameters"]["pretrained"] = "runs/vit_start/best.ckpt"
    checkpoint["hyper_parameters"]["distillation"]["teacher"] = "runs/teacher/best.ckpt"
    copy = tmp_path / "elsewhere" / "vit.ckpt"
    copy.parent.mkdir()
    torch.save(checkpoint, copy)
    return copy


def test_a_vit_copied_alone_tests_like_the_original_and_predicts_what_classify_gives(vit_checkpoint, vit_copy,
                                                                                      tmp_path) -> None:
    """The copy tests as the original does; its predictions (the Fashion-MNIST test images, named test/<index>)
    are what `classify` writes for the same images saved as PNG files."""
    from vision_attn.datamodules import FashionMNISTDataModule

    common = tiny("vit_tiny.yaml")  # two test batches of 64
    original = printed_metrics(ok(run_in_process("test", *common, "--ckpt_path", str(vit_checkpoint),
                                                 "--trainer.default_root_dir", str(tmp_path / "original"))))
    copied = printed_metrics(ok(run_in_process("test", *common, "--ckpt_path", str(vit_copy),
                                               "--trainer.default_root_dir", str(tmp_path / "copied"))))
    assert copied == original and "test/acc" in copied
    ok(run_in_process("predict", *tiny("vit_tiny.yaml"), "--ckpt_path", str(vit_copy),
                      "--data.init_args.loader.eval_batch_size", "16", "--trainer.limit_predict_batches", "2",
                      "--trainer.default_root_dir", str(tmp_path / "run")))
    predicted = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert [r["file_name"] for r in predicted] == [f"test/{i}" for i in range(32)]  # two batches of 16, in order
    data = FashionMNISTDataModule(val_size=5000)
    data.setup("test")
    folder = tmp_path / "images"
    folder.mkdir()
    for index in range(8):
        Image.fromarray(data.test_set.images[index, 0].numpy(), mode="L").save(folder / f"test_{index}.png")
    ok(run_in_process("classify", "--ckpt", str(vit_copy), str(folder), "--out", str(tmp_path / "classes.json")))
    classified = json.loads((tmp_path / "classes.json").read_text())
    assert [r["file_name"] for r in classified] == [str(folder / f"test_{i}.png") for i in range(8)]
    for theirs, ours in zip(classified, predicted, strict=False):
        assert [entry["class"] for entry in theirs["top_k"]] == [entry["class"] for entry in ours["top_k"]]
        assert [entry["probability"] for entry in theirs["top_k"]] == \
            pytest.approx([entry["probability"] for entry in ours["top_k"]], abs=1e-5)


@pytest.mark.heavy
def test_predict_with_two_processes_writes_what_one_writes(vit_checkpoint, tmp_path) -> None:
    """Under DDP each rank predicts its share; rank 0 writes every image once, in the predict set's order."""
    common = ["predict", *tiny("vit_tiny.yaml"), "--ckpt_path", str(vit_checkpoint),
              "--data.init_args.loader.eval_batch_size", "25", "--trainer.limit_predict_batches", "2"]
    ok(run_in_process(*common, "--trainer.default_root_dir", str(tmp_path / "one"),
                      "--trainer.limit_predict_batches", "4"))
    two = run_script(*common, "--trainer.default_root_dir", str(tmp_path / "two"), "--trainer.strategy", "ddp",
                     "--trainer.devices", "2", "--trainer.accelerator", "cpu")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("wrote 100 predictions to") == 1  # rank 0 alone writes and says so
    one = json.loads((tmp_path / "one" / "predictions.json").read_text())
    assert json.loads((tmp_path / "two" / "predictions.json").read_text()) == one and len(one) == 100


def test_fit_or_predict_from_last_with_no_last_checkpoint_is_refused_in_one_line(tmp_path, capsys) -> None:
    """`--ckpt_path last` with nothing to resume: exit 2 and one line naming where it looked, before any work;
    a missing path is refused so too, and predict without a checkpoint."""
    run = tmp_path / "run"
    common = [*tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(run)]
    line = fails_in_one_line(capsys, ["fit", *common, "--ckpt_path", "last"])
    assert line == (f"error: --ckpt_path last: no last checkpoint in {run / 'checkpoints'}; pass the checkpoint's "
                    "path, or fit without --ckpt_path to start anew")
    assert "no last checkpoint" in fails_in_one_line(capsys, ["predict", *common, "--ckpt_path", "last"])
    missing = tmp_path / "gone" / "last.ckpt"
    assert str(missing) in fails_in_one_line(capsys, ["fit", *common, "--ckpt_path", str(missing)])
    assert "predict needs --ckpt_path" in fails_in_one_line(capsys, ["predict", *common])
    assert not run.exists() and not (tmp_path / "gone").exists()
