"""The captioner through the real entry point: fit/test on a tiny scenes set, then `caption` on files and COCO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import run_in_process, run_script, tiny
from tests.test_formats import schema_errors

RESULT_KEYS = {"image_id", "file_name", "caption", "tokens", "grid", "image_size", "alphas", "betas"}


def check_records(records: list[dict], count: int) -> None:
    assert len(records) == count
    for record in records:
        assert RESULT_KEYS <= set(record)
        grid_h, grid_w = record["grid"]
        assert (grid_h, grid_w) == (6, 6) and record["image_size"] == [96, 96]
        assert len(record["alphas"]) == len(record["tokens"]) == len(record["betas"])
        assert record["caption"] == " ".join(record["tokens"])
        for row in record["alphas"]:
            assert len(row) == grid_h * grid_w and abs(sum(row) - 1) < 1e-3


def test_fit_writes_checkpoints_and_the_vocabulary_json(trained_captioner) -> None:
    checkpoint_dir = trained_captioner["ckpt"].parent
    assert (checkpoint_dir / "last.ckpt").exists()
    vocabulary = json.loads((checkpoint_dir / "vocab.json").read_text())["tokens"]
    assert vocabulary[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert {"a", "of", "the"} <= set(vocabulary)  # words every scene caption set uses


def test_test_command_reports_coco_metrics_and_pointing_and_writes_results(trained_captioner, tmp_path) -> None:
    result = run_in_process("test", *tiny("captioner_tiny.yaml"),
                            "--data.init_args.root", str(trained_captioner["scenes"]),
                            "--ckpt_path", str(trained_captioner["ckpt"]),
                            "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    # pointing is computed on scenes; its accuracy is reported once the model names objects (not this 3-step one)
    for metric in ("test/BLEU-4", "test/CIDEr-D", "test/ROUGE-L", "test/METEOR", "test/pointing_words"):
        assert metric in result.stdout, metric
    records = json.loads((tmp_path / "results_test.json").read_text())
    check_records(records, 6)
    assert sorted(r["image_id"] for r in records) == list(range(1, 7))  # one result per test image
    for record in records:  # each names its image file, so overlay and explore read the file as it is
        assert Path(record["file_name"]).is_file() and Path(record["file_name"]).stem == str(record["image_id"])
    assert schema_errors(records) == []  # docs/formats/results.schema.json


def test_results_json_feeds_pycocoevalcap(trained_captioner, tmp_path) -> None:
    from pycocotools.coco import COCO

    out = tmp_path / "results.json"
    result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), "--coco-annotations",
                            str(trained_captioner["scenes"] / "annotations" / "captions_test.json"),
                            "--image-dir", str(trained_captioner["scenes"] / "images" / "test"), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    check_records(json.loads(out.read_text()), 6)
    coco = COCO(str(trained_captioner["scenes"] / "annotations" / "captions_test.json"))
    coco_results = coco.loadRes(str(out))  # the COCO results format: image_id + caption
    assert sorted(coco_results.getImgIds()) == sorted(coco.getImgIds())


def test_caption_own_images_of_odd_sizes_and_modes(trained_captioner, tmp_path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    Image.new("L", (37, 121), 90).save(folder / "tall_grey.png")
    Image.new("RGBA", (300, 40), (200, 10, 10, 128)).save(folder / "wide_rgba.png")
    Image.new("CMYK", (64, 64), (0, 120, 200, 0)).save(folder / "cmyk.jpg")
    Image.new("P", (50, 50)).save(folder / "palette.gif")
    out = tmp_path / "out" / "results.json"
    result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), str(folder), "--beam", "3",
                            "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    check_records(records, 4)
    assert [r["image_id"] for r in records] == ["cmyk.jpg", "palette.gif", "tall_grey.png", "wide_rgba.png"]
    assert len(result.stdout.strip().splitlines()) == 5  # one caption per image, then where the JSON went


def test_caption_refuses_a_vit_checkpoint_in_one_line(tmp_path) -> None:
    import torch

    bogus = tmp_path / "vit.ckpt"
    torch.save({"vision_attn_kind": "vit", "state_dict": {}, "hyper_parameters": {}}, bogus)
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    result = run_in_process("caption", "--ckpt", str(bogus), str(image))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: {bogus}: this is a ViT classifier checkpoint, but a Show-Attend-Tell "
                                     "captioner is needed")


def test_self_critical_epochs_train_on_sampled_captions_with_the_cider_reward(trained_captioner, tmp_path) -> None:
    import csv

    from vision_attn.cli import main

    main(["fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
          str(trained_captioner["scenes"]), "--data.init_args.group_captions", "true",
          "--model.init_args.self_critical.from_epoch", "1", "--trainer.max_epochs", "2",
          "--trainer.log_every_n_steps", "1", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
          "--trainer.logger.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path)])
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    by_epoch = {}
    for row in rows:
        if row.get("train/loss"):
            by_epoch.setdefault(int(row["epoch"]), []).append(row)
    assert sorted(by_epoch) == [0, 1]
    assert not any(row.get("train/reward") for row in by_epoch[0])  # epoch 0: likelihood, teacher forcing
    rewards = [float(row["train/reward"]) for row in by_epoch[1]]  # epoch 1: CIDEr-D of the model's samples
    assert len(rewards) == 3 and all(reward >= 0 for reward in rewards)


def test_hard_attention_trains_self_critically_from_the_start_of_the_time_budget(trained_captioner, tmp_path) -> None:
    """self_critical.from_progress is a share of the run (of max_time, with schedule.by_time): 0 turns training
    self-critical from the first step (the scenes default test shows the switch mid-run). Hard attention trains
    self-critically too: its sampled locations share the caption's reward."""
    import csv

    from vision_attn.cli import main

    main(["fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
          str(trained_captioner["scenes"]), "--data.init_args.group_captions", "true",
          "--model.init_args.decoder.attention_mode", "hard", "--model.init_args.self_critical.from_progress", "0.0",
          "--model.init_args.schedule.by_time", "true", "--trainer.max_time", "00:01:00:00",
          "--trainer.max_epochs", "1", "--trainer.log_every_n_steps", "1",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path),
          "--trainer.default_root_dir", str(tmp_path)])
    rows = [row for row in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if row.get("train/loss")]
    assert rows and all(row.get("train/reward") for row in rows)


def test_self_critical_training_needs_grouped_captions_in_one_line(trained_captioner, tmp_path) -> None:
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                            str(trained_captioner["scenes"]), "--model.init_args.self_critical.from_epoch", "0",
                            "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode != 0
    assert "group_captions: true" in result.stderr and "Traceback" not in result.stderr


def test_evaluate_scores_caption_results_and_a_bare_coco_results_list(trained_captioner, tmp_path, capsys) -> None:
    from vision_attn.cli import main

    scenes = trained_captioner["scenes"]
    annotations = scenes / "annotations" / "captions_test.json"
    instances, attributes = (scenes / "annotations" / f"{kind}_test.json" for kind in ("instances", "attributes"))
    results = tmp_path / "results.json"
    main(["caption", "--ckpt", str(trained_captioner["ckpt"]), "--coco-annotations", str(annotations), "--image-dir",
          str(scenes / "images" / "test"), "--out", str(results)])
    scores_file = tmp_path / "scores.json"
    main(["evaluate", str(results), "--annotations", str(annotations), "--instances", str(instances), "--attributes",
          str(attributes), "--out", str(scores_file)])
    printed = capsys.readouterr().out
    scores = json.loads(scores_file.read_text())
    for name in ("BLEU-4", "CIDEr-D", "pointing_words", "object_recall", "repeated_object_rate", "images"):
        assert name in scores and name in printed
    assert scores["images"] == 6 and 0.0 <= scores["object_recall"] <= 1.0
    # another tool's output: the bare COCO results format, no attention: caption and scene metrics, no pointing
    bare = tmp_path / "bare.json"
    truth = json.loads(annotations.read_text())["annotations"]
    first = {a["image_id"]: a["caption"] for a in reversed(truth)}  # one reference per image, the first
    bare.write_text(json.dumps([{"image_id": image_id, "caption": caption} for image_id, caption in first.items()]))
    main(["evaluate", str(bare), "--annotations", str(annotations), "--instances", str(instances), "--attributes",
          str(attributes), "--out", str(tmp_path / "bare_scores.json")])
    bare_scores = json.loads((tmp_path / "bare_scores.json").read_text())
    assert "pointing_accuracy" not in bare_scores and bare_scores["object_recall"] == 1.0
    assert bare_scores["colour_accuracy"] == 1.0 and bare_scores["object_precision"] == 1.0  # a reference caption
    assert bare_scores["BLEU-4"] > 0.9


def test_evaluate_names_image_ids_missing_from_the_annotations(trained_captioner, tmp_path, capsys) -> None:
    import pytest

    from vision_attn.cli import main

    annotations = trained_captioner["scenes"] / "annotations" / "captions_test.json"
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps([{"image_id": 1, "caption": "a top"}, {"image_id": 987, "caption": "a bag"}]))
    with pytest.raises(SystemExit):
        main(["evaluate", str(stray), "--annotations", str(annotations), "--out", str(tmp_path / "s.json")])
    assert capsys.readouterr().err.strip() == f"error: {stray}: 1 image ids are not in {annotations}, e.g. 987"
    assert not (tmp_path / "s.json").exists()


def test_the_scenes_default_config_runs_both_phases_in_a_tiny_run(pretrained_encoder, tmp_path) -> None:
    """configs/captioner/fashion_scenes.yaml as it is (an encoder pretrained by fashion_scene_items.yaml, styled
    training scenes, coverage, concept loss, the schedule), on 32 scenes for one epoch of 4 steps: both phases
    run, a best checkpoint is kept, and it captions without the concept head (a training aid only).
    Steps, not a time budget (the schedule follows the steps without max_time): with a 10-second budget, a
    first step of over 10 s on a loaded machine (under scripts/slower_cpu.sh, beside the other tests) ended the
    fit before the switch. The switch by the clock is the two-process test's below, and RunSchedule's own."""
    import csv
    import json
    import time

    import torch

    from tests.conftest import shipped
    from vision_attn.captioning.captioner import Captioner
    from vision_attn.captioning.evaluation import caption_files
    from vision_attn.cli import main

    started = time.monotonic()
    main(["fit", *shipped("trainer/cpu.yaml", "tasks/captioner.yaml", "captioner/fashion_scenes.yaml"),
          "--data.init_args.root", str(tmp_path / "scenes"),
          "--data.init_args.scenes.counts", '{"train": 32, "val": 8, "test": 8}',
          "--data.init_args.loader.batch_size", "8", "--model.init_args.encoder.pretrained", str(pretrained_encoder),
          "--trainer.max_time", "null", "--trainer.max_epochs", "1",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
          "--trainer.logger.save_dir", str(tmp_path / "run"), "--trainer.log_every_n_steps", "1",
          "--trainer.default_root_dir", str(tmp_path / "run")])
    assert time.monotonic() - started < 120
    info = json.loads((tmp_path / "scenes" / "annotations" / "captions_train.json").read_text())["info"]
    assert info["style"]["layout"] == "mixed"
    rows = [row for row in csv.DictReader(next((tmp_path / "run").rglob("metrics.csv")).open())
            if row.get("train/loss")]
    phases = [bool(row.get("train/reward")) for row in rows]
    assert phases == [False, False, True, True]  # likelihood for the first half of the steps, then self-critical
    assert [float(row["train/concept_loss"]) for row in rows if row.get("train/concept_loss")]
    # The checkpoint holds the coverage weights and the concept head; the captioner loads without the head.
    checkpoint = tmp_path / "run" / "checkpoints" / "best.ckpt"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert "auxiliary.concept.head.weight" in saved and "model.decoder.attention_inputs.coverage.proj.weight" in saved
    captioner = Captioner.from_checkpoint(checkpoint)
    assert not any("concept" in name for name, _ in captioner.named_parameters())
    image = next((tmp_path / "scenes" / "images" / "test").glob("*.png"))
    [record] = caption_files(captioner, [(1, image)])
    assert record["caption"] and len(record["alphas"]) == len(record["tokens"]) > 0


@pytest.mark.heavy
def test_two_ddp_processes_switch_to_self_critical_training_by_the_time_budget(trained_captioner, tmp_path) -> None:
    """With two processes the switch follows rank 0's clock (a broadcast each step until it comes): the fit
    runs both phases and ends by its budget, with no rank left waiting. No validation: on a loaded machine the
    first one (METEOR's start among it) once took the whole budget, ending the fit before the switch."""
    import csv

    result = run_script("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                        str(trained_captioner["scenes"]), "--data.init_args.group_captions", "true",
                        "--model.init_args.self_critical.from_progress", "0.3", "--trainer.limit_val_batches", "0",
                        "--model.init_args.schedule.by_time", "true", "--trainer.max_time", "00:00:00:08",
                        "--trainer.max_epochs", "1000", "--trainer.strategy", "ddp", "--trainer.devices", "2",
                        "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1",
                        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                        "--trainer.logger.save_dir", str(tmp_path), "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [row for row in csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()) if row.get("train/loss")]
    phases = [bool(row.get("train/reward")) for row in rows]
    assert not phases[0] and phases[-1] and phases == sorted(phases)


def test_the_encoder_pretrains_on_scene_items_and_a_captioner_starts_from_it(pretrained_encoder, tmp_path) -> None:
    """configs/captioner/fashion_scene_items.yaml logs class and colour accuracy and writes an encoder
    checkpoint; a captioner loads its trunk exactly, and refuses it, in one line, under another normalisation
    or encoder width, or when the file is missing."""
    import csv

    import torch

    from vision_attn.data.vocabulary import SPECIALS
    from vision_attn.errors import CheckpointError
    from vision_attn.tasks import CaptionerTask

    rows = list(csv.DictReader(next(pretrained_encoder.parents[1].rglob("metrics.csv")).open()))
    [val] = [row for row in rows if row.get("val/acc")]
    assert 0 <= float(val["val/acc"]) <= 1 and 0 <= float(val["val/colour_acc"]) <= 1
    [train] = [row for row in rows if row.get("train/acc")]  # counted at each step, logged once at the epoch's end
    assert 0 <= float(train["train/acc"]) <= 1 and 0 <= float(train["train/colour_acc"]) <= 1
    assert int(train["step"]) == 5  # the 6 steps' epoch
    saved = torch.load(pretrained_encoder, map_location="cpu", weights_only=True)
    assert saved["vision_attn_kind"] == "encoder"
    assert saved["hyper_parameters"]["colour_names"] == ["red", "green", "blue", "yellow", "white"]

    def captioner(pretrained: str, width: int = 24, **image) -> CaptionerTask:
        return CaptionerTask(vocabulary=[*SPECIALS, "a", "red", "top"], image={"size": 96, **image},
                             encoder={"width": width, "pretrained": pretrained})

    trunk = captioner(str(pretrained_encoder)).model.encoder.trunk.state_dict()
    assert len(trunk) == 4 * 6  # 4 stages: conv, BN weight, bias, running mean, var and count
    for name, tensor in trunk.items():
        assert torch.equal(tensor, saved["state_dict"][f"model.encoder.trunk.{name}"]), name
    with pytest.raises(CheckpointError, match=r"pretrained on images normalised with mean \[0.485"):
        captioner(str(pretrained_encoder), mean=[0.5] * 3, std=[0.5] * 3)
    with pytest.raises(CheckpointError, match=r"weights for another architecture than the small trunk, .* is "):
        captioner(str(pretrained_encoder), width=16)
    missing = tmp_path / "runs" / "encoder" / "best.ckpt"
    with pytest.raises(CheckpointError, match=f"{missing}: no such file"):
        captioner(str(missing))


def test_all_beams_lists_every_beam_of_the_search_best_first(trained_captioner, tmp_path) -> None:
    """`caption --all-beams` (here in-process): each record adds its search's beams, the first being the record's
    own caption, each with α and β rows per word; the file still reads as results records."""
    from vision_attn.captioning.evaluation import write_captions
    from vision_attn.results import read_results, record_problem

    image = tmp_path / "one.png"
    Image.new("RGB", (96, 96), (30, 120, 200)).save(image)
    written = write_captions(trained_captioner["ckpt"], [("one.png", image)], tmp_path / "beams.json", beam_size=3,
                             all_beams=True)
    record = json.loads(written.path.read_text())[0]
    assert len(record["beams"]) == 3 and record_problem(record) is None
    assert record["beams"][0]["caption"] == record["caption"] and record["beams"][0]["alphas"] == record["alphas"]
    scores = [beam["score"] for beam in record["beams"]]
    assert scores == sorted(scores, reverse=True)
    for beam in record["beams"]:
        assert len(beam["alphas"]) == len(beam["tokens"]) == len(beam["betas"])
    read_results(written.path)  # a results file with beams is still readable by overlay and explore
    broken = {**record, "beams": [{**record["beams"][1], "alphas": []}]}
    assert record_problem(broken).startswith("beam 0 alphas must hold one row per token")


def test_explore_runs_a_captioner_checkpoint_on_images_first(trained_captioner, tmp_path) -> None:
    """`explore --ckpt` captions the images (keeping every beam) and writes the site with their data."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for k in range(2):
        Image.new("RGB", (96, 80), (40 * k, 120, 200)).save(folder / f"photo_{k}.png")
    result = run_in_process("explore", "--ckpt", str(trained_captioner["ckpt"]), "--images", str(folder),
                            "--beam", "2", "--out", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    item = json.loads((tmp_path / "site" / "data" / "items" / "1.js").read_text().removeprefix("VA.item(")
                      .rstrip().removesuffix(");"))
    assert item["kind"] == "captioner" and item["file"] == "photo_1.png" and item["grid"] == [6, 6]
    assert len(item["beams"]) == 2 and item["beams"][0]["caption"] == item["caption"]
    assert (tmp_path / "site" / "images" / "1.png").is_file() and (tmp_path / "site" / "thumbs" / "1.jpg").is_file()
