"""Refusals only where data is really wrong: a command that reads some splits of a Fashion scenes root checks only
those splits' styles, and names the split and the fields that differ; `evaluate` takes what `caption` writes for
the files of a split, matched to the split's annotations by file name."""

from __future__ import annotations

import json

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


def test_evaluate_scores_what_caption_writes_for_the_files_of_a_split(trained_captioner, tmp_path) -> None:
    """make-scenes -> caption (the test split's image files: ids '1.png' ...) -> evaluate against the split's
    annotations and instances: the same scores as for the same captions under their COCO ids. A file name that
    fits two images, or none, and two records of one image are one line each."""
    root, ckpt = tmp_path / "scenes", str(trained_captioner["ckpt"])
    made = run_in_process("make-scenes", "--root", str(root), "--train", "2", "--val", "1", "--test", "3")
    assert made.returncode == 0, made.stderr[-2000:]
    annotations, images = root / "annotations", root / "images" / "test"
    by_file = run_in_process("caption", "--ckpt", ckpt, str(images), "--out", str(tmp_path / "files.json"))
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    assert [r["image_id"] for r in json.loads((tmp_path / "files.json").read_text())] == ["1.png", "2.png", "3.png"]
    by_id = run_in_process("caption", "--ckpt", ckpt, "--coco-annotations", str(annotations / "captions_test.json"),
                           "--image-dir", str(images), "--out", str(tmp_path / "ids.json"))
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    scored = []
    for results in ("files.json", "ids.json"):
        done = run_in_process("evaluate", str(tmp_path / results), "--annotations",
                              str(annotations / "captions_test.json"), "--instances",
                              str(annotations / "instances_test.json"), "--attributes",
                              str(annotations / "attributes_test.json"), "--out", str(tmp_path / f"scores_{results}"))
        assert done.returncode == 0, done.stderr[-2000:]
        scored.append(json.loads((tmp_path / f"scores_{results}").read_text()))
    assert scored[0] == scored[1] and scored[0]["images"] == 3 and "pointing_words" in scored[0]

    def refused(records: list[dict], images_of: list[dict] | None = None) -> str:
        (tmp_path / "bad.json").write_text(json.dumps(records))
        captions = json.loads((annotations / "captions_test.json").read_text())
        if images_of is not None:
            captions["images"] = images_of
        (tmp_path / "captions.json").write_text(json.dumps(captions))
        return one_line_error(run_in_process("evaluate", str(tmp_path / "bad.json"), "--annotations",
                                             str(tmp_path / "captions.json"), "--out", str(tmp_path / "s.json")))

    assert refused([{"image_id": "9.png", "caption": "a bag"}]).endswith(
        "1 image ids are not in " f"{tmp_path / 'captions.json'}, e.g. '9.png' (neither an image id nor an image's "
        "file_name there)")
    assert refused([{"image_id": "1.png", "caption": "a bag"}, {"image_id": 1, "caption": "a bag"}]).endswith(
        "records 0 and 1 are both image 1 of " f"{tmp_path / 'captions.json'} (an image id or its file name)")
    twice = [{"id": 1, "file_name": "a/1.png"}, {"id": 2, "file_name": "b/1.png"}, {"id": 3, "file_name": "3.png"}]
    assert refused([{"image_id": "1.png", "caption": "a bag"}], twice).endswith(
        "image '1.png' is the file name of 2 images of " f"{tmp_path / 'captions.json'} (ids 1, 2): give it by its "
        "image id")
    assert not (tmp_path / "s.json").exists()
