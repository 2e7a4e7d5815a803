"""Checkpoints written before the option groups (vision-attn 0.1, ``tests/fixtures/legacy/``), and one written in
the groups before the extension lists (``captioner_grouped.ckpt``), load through every command, with the results
they gave then: ``caption``, ``classify``, ``overlay``, ``explore`` and
``vision-attn test --ckpt_path``, the older form with the weights at the top and the ``attention`` key too, and a
checkpoint copied away from the files its fit started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import printed_metrics as printed_rows
from tests.conftest import run_in_process, shipped, tiny
from vision_attn.checkpoint import CAPTIONER, KIND_KEY, load_file, upgrade

LEGACY = Path(__file__).parent / "fixtures" / "legacy"


def same_records(ours: list[dict], theirs: list[dict]) -> None:
    """The same captions, word for word, with the same α and β (to rounding: another CPU's kernels)."""
    assert [(r["image_id"], r["tokens"], r["grid"], r["image_size"]) for r in ours] == \
        [(r["image_id"], r["tokens"], r["grid"], r["image_size"]) for r in theirs]
    for mine, recorded in zip(ours, theirs, strict=True):
        for key in ("alphas", "betas"):
            assert torch.tensor(mine[key]) == pytest.approx(torch.tensor(recorded[key]), rel=1e-3, abs=1e-5), key


@pytest.mark.parametrize("name", ["captioner", "captioner_vit", "captioner_grouped"])
def test_a_legacy_captioner_captions_as_it_did(name: str, tmp_path: Path) -> None:
    out = tmp_path / "captions.json"
    result = run_in_process("caption", "--ckpt", str(LEGACY / f"{name}.ckpt"), str(LEGACY / "scene_1.png"),
                            str(LEGACY / "scene_2.png"), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    same_records(json.loads(out.read_text()), json.loads((LEGACY / f"{name}_captions.json").read_text()))


def test_a_legacy_vit_classifies_as_it_did(tmp_path: Path) -> None:
    result = run_in_process("classify", "--ckpt", str(LEGACY / "vit.ckpt"), str(LEGACY / "02890_Sandal.png"),
                            str(LEGACY / "06044_Trouser.png"), "--out", str(tmp_path / "classes.json"))
    assert result.returncode == 0, result.stderr[-2000:]

    def ranked(text: str) -> list[tuple[str, float]]:
        return [(line.split("%", 1)[1].strip(), float(line.split("%")[0])) for line in text.splitlines()
                if "%" in line]

    ours, recorded = ranked(result.stdout), ranked((LEGACY / "vit_classify.txt").read_text())
    assert [name for name, _ in ours] == [name for name, _ in recorded]
    assert [p for _, p in ours] == pytest.approx([p for _, p in recorded], abs=0.011)


@pytest.mark.parametrize("checkpoint", ["captioner.ckpt", "vit.ckpt"])
def test_legacy_checkpoints_draw_overlays_and_the_explorer(checkpoint: str, tmp_path: Path) -> None:
    images = [LEGACY / "scene_1.png"] if checkpoint.startswith("captioner") else [LEGACY / "02890_Sandal.png"]
    overlaid = run_in_process("overlay", "--ckpt", str(LEGACY / checkpoint), *map(str, images),
                              "--out", str(tmp_path / "overlays"))
    assert overlaid.returncode == 0, overlaid.stderr[-2000:]
    assert len(list((tmp_path / "overlays").glob("*.png"))) == 1
    explored = run_in_process("explore", "--ckpt", str(LEGACY / checkpoint), "--images", *map(str, images),
                              "--out", str(tmp_path / "site"))
    assert explored.returncode == 0, explored.stderr[-2000:]
    assert (tmp_path / "site" / "index.html").is_file()


def printed_metrics(stdout: str) -> dict[str, float]:
    return {name: float(value) for name, value in printed_rows(stdout).items()}


# each legacy checkpoint with the config that trained it, and what `test` needs of the data
TESTED = {
    "captioner": (tiny("captioner_tiny.yaml"), ["--data.init_args.object_targets", "true"]),
    "captioner_grouped": (tiny("captioner_tiny.yaml"), ["--data.init_args.object_targets", "true"]),
    "vit": (tiny("vit_tiny.yaml"), []),
    "convnet": (shipped("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml",
                        "vit/fashion_mnist_teacher.yaml"),  # with the smaller model it was fitted as
                ["--trainer.limit_test_batches", "2", "--model.init_args.architecture.widths", "[4, 8]"]),
    "encoder_pretraining": (shipped("trainer/cpu.yaml", "tasks/classifier.yaml", "captioner/fashion_scene_items.yaml"),
                            ["--trainer.limit_test_batches", "2",  # its items as they were drawn then (no clutter)
                             "--data.init_args.style", '{"hue_jitter": 1.0, "scale_jitter": 0.1}',
                             "--model.init_args.encoder.width", "4", "--model.init_args.encoder.stride", "16"]),
}


@pytest.mark.parametrize("name", sorted(TESTED))
def test_a_legacy_checkpoint_tests_to_the_metrics_it_gave(name: str, tmp_path: Path) -> None:
    configs, data = TESTED[name]
    if name.startswith("captioner"):
        data = [*data, "--data.init_args.root", str(tmp_path / "scenes")]  # the tiny config's scenes, drawn again
    result = run_in_process("test", *configs, *data, "--ckpt_path", str(LEGACY / f"{name}.ckpt"),
                            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false",
                            "--trainer.enable_progress_bar", "false")
    assert result.returncode == 0, result.stderr[-3000:]
    ours, recorded = printed_metrics(result.stdout), json.loads((LEGACY / f"{name}_test_metrics.json").read_text())
    assert recorded.keys() <= ours.keys()  # a metric added since the checkpoint's day is new, not changed
    for metric, value in recorded.items():
        assert ours[metric] == pytest.approx(value, rel=1e-4, abs=1e-6), metric


def test_the_oldest_form_captions_and_tests_the_same(tmp_path: Path) -> None:
    """Before the LightningModule held a ``Captioner``, the encoder's and decoder's weights were at the top of the
    state dict, and ``attention`` was ``attention_mode``: such a checkpoint captions as the legacy one does, and
    ``vision-attn test`` reads it (it refused the ``attention`` key before the option groups)."""
    checkpoint = load_file(LEGACY / "captioner.ckpt")
    assert checkpoint[KIND_KEY] == CAPTIONER
    checkpoint["state_dict"] = {key.removeprefix("model."): value for key, value in checkpoint["state_dict"].items()}
    checkpoint["hyper_parameters"]["attention"] = checkpoint["hyper_parameters"].pop("attention_mode")
    oldest = tmp_path / "oldest.ckpt"
    torch.save(checkpoint, oldest)
    assert upgrade(load_file(oldest))["hyper_parameters"]["decoder"]["attention_mode"] == "soft"
    out = tmp_path / "captions.json"
    result = run_in_process("caption", "--ckpt", str(oldest), str(LEGACY / "scene_1.png"), str(LEGACY / "scene_2.png"),
                            "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    same_records(json.loads(out.read_text()), json.loads((LEGACY / "captioner_captions.json").read_text()))
    tested = run_in_process("test", *tiny("captioner_tiny.yaml"), "--data.init_args.object_targets", "true",
                            "--data.init_args.root", str(tmp_path / "scenes"), "--ckpt_path", str(oldest),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert tested.returncode == 0, tested.stderr[-3000:]
    recorded = json.loads((LEGACY / "captioner_test_metrics.json").read_text())
    assert printed_metrics(tested.stdout)["test/CIDEr-D"] == pytest.approx(recorded["test/CIDEr-D"], rel=1e-4)


def test_a_checkpoint_copied_away_from_its_initial_weights_tests_and_captions(tmp_path: Path) -> None:
    """captioner_vit.ckpt names the ViT checkpoint its fit started from (a path of the machine that wrote it); its
    own weights hold that ViT, so `test` and `caption` run with the checkpoint alone in a new folder."""
    checkpoint = load_file(LEGACY / "captioner_vit.ckpt")
    assert checkpoint["hyper_parameters"]["pretrained_encoder"]  # where the machine that wrote it had the ViT
    checkpoint["hyper_parameters"]["pretrained_encoder"] = str(tmp_path / "gone" / "vit.ckpt")  # not here
    copy = tmp_path / "elsewhere" / "model.ckpt"
    copy.parent.mkdir()
    torch.save(checkpoint, copy)
    tested = run_in_process("test", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(tmp_path / "scenes"),
                            "--data.init_args.image_size", "84", "--model.init_args.encoder.backbone", "vit",
                            "--ckpt_path", str(copy),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "test/CIDEr-D" in tested.stdout
    out = tmp_path / "captions.json"
    captioned = run_in_process("caption", "--ckpt", str(copy), str(LEGACY / "scene_1.png"), "--out", str(out))
    assert captioned.returncode == 0, captioned.stderr[-2000:]


def test_a_grouped_checkpoint_from_before_the_extension_lists_lists_them() -> None:
    """``captioner_grouped.ckpt`` had every extension as a flag or weight of its group: upgraded, each is an entry of
    today's lists, with the options it had, and its weights are under the extensions' names."""
    loaded = upgrade(load_file(LEGACY / "captioner_grouped.ckpt"))
    hparams, state = loaded["hyper_parameters"], loaded["state_dict"]
    assert hparams["decoder"]["attention_inputs"] == ["previous_word", "coverage"]  # the scaled-dot score's order
    assert hparams["decoder"]["output_terms"] == [{"name": "word_counts", "context": True}]
    assert [entry["name"] for entry in hparams["decoding"]["processors"]] == ["blocked_endings", "revisit_penalty"]
    assert hparams["objective"]["auxiliary"] == [
        {"name": "concept", "weight": 0.5}, {"name": "object", "weight": 1.0, "heads_from_encoder": False},
        {"name": "grounding", "weight": 1.0, "target": "inside"}]
    assert hparams["self_critical"]["rewards"] == [{"name": "repeat", "weight": 1.0},
                                                   {"name": "hallucination", "weight": 0.5},
                                                   {"name": "recall", "weight": 1.0}]
    assert "aids" not in hparams and not any(key.startswith("aids.") for key in state)
    for name in ("model.decoder.attention_inputs.coverage.proj.weight", "model.decoder.output_terms.word_counts.weight",
                 "model.decoder.output_terms.word_counts.context.weight", "auxiliary.object.colour_head.weight"):
        assert name in state
