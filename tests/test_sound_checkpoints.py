"""Checkpoints proven sound before use, one safe loader on every path, and options that do what they say: a damaged
or non-finite checkpoint, a field of the wrong type, a pickle payload reached through a name Lightning resolves or a
CheckpointIO the config names, a non-finite score, and the options a checkpoint's own would silently replace."""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from tests.conftest import run_in_process, tiny
from tests.test_security import evil_checkpoints
from vision_attn.api import caption, load_captioner
from vision_attn.checkpoint import CheckpointError, load_file
from vision_attn.data.vocabulary import SPECIALS
from vision_attn.io import write_json_atomically
from vision_attn.trainer_cli import VisionAttnCLI


def altered(source: Path, target: Path, **fields: object) -> Path:
    """A copy of the checkpoint ``source`` at ``target`` with ``fields`` set over its own."""
    torch.save({**torch.load(source, weights_only=True), **fields}, target)
    return target


def one_line_error(done, *words: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines and lines[-1].startswith("error: "), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "weights_only" not in done.stderr, done.stderr[-2000:]
    for word in words:
        assert word in lines[-1], lines[-1]


def test_a_checkpoint_whose_bytes_fail_their_crc_is_refused_naming_it(trained_captioner, tmp_path) -> None:
    source = trained_captioner["ckpt"]
    with zipfile.ZipFile(source) as archive:
        member = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(source.read_bytes())
    start = member.header_offset + 30 + len(member.filename) + len(member.extra) + 8
    for offset in range(start, start + min(1000, member.file_size - 16)):
        data[offset] ^= 0xFF  # the stored bytes change, the member's CRC does not: torch alone reads them
    damaged = tmp_path / "flipped.ckpt"
    damaged.write_bytes(bytes(data))
    done = run_in_process("caption", "--ckpt", str(damaged), str(trained_captioner["scenes"] / "images" / "test"),
                          "--out", str(tmp_path / "out.json"))
    one_line_error(done, str(damaged), "CRC", member.filename)
    assert not (tmp_path / "out.json").exists()


def test_non_finite_weights_are_refused_at_load_naming_the_first(trained_captioner, tmp_path) -> None:
    loaded = torch.load(trained_captioner["ckpt"], weights_only=True)
    state = {name: value.clone() for name, value in loaded["state_dict"].items()}
    first = next(name for name, value in state.items() if value.is_floating_point())
    for name in list(state)[list(state).index(first):]:
        if state[name].is_floating_point():
            state[name].fill_(float("nan"))
    state[first].view(-1)[0] = float("inf")
    path = altered(trained_captioner["ckpt"], tmp_path / "nan.ckpt", state_dict=state)
    with pytest.raises(CheckpointError, match=f"the weight {first} holds NaN or infinite"):
        load_file(path)
    done = run_in_process("caption", "--ckpt", str(path), str(trained_captioner["scenes"] / "images" / "test"),
                          "--out", str(tmp_path / "out.json"))
    one_line_error(done, str(path), first)


@pytest.mark.parametrize(("fields", "named"), [
    ({"vision_attn_kind": ["captioner"]}, "vision_attn_kind"),
    ({"vision_attn_version": 3}, "vision_attn_version"),
    ({"hyper_parameters": [1, 2]}, "hyper_parameters"),
    ({"state_dict": {"model.x": "not a tensor"}}, "state_dict"),
    ({"global_step": "7"}, "global_step"),
    ({"vision_attn_rng": {"torch": [1, 2]}}, "vision_attn_rng.torch"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_it(trained_captioner, tmp_path, fields, named) -> None:
    path = altered(trained_captioner["ckpt"], tmp_path / "typed.ckpt", **fields)
    done = run_in_process("caption", "--ckpt", str(path), str(trained_captioner["scenes"] / "images" / "test"),
                          "--out", str(tmp_path / "out.json"))
    one_line_error(done, str(path), named)


@pytest.mark.parametrize(("group", "value", "named"), [
    ("vocabulary", 5, "hyper_parameters.vocabulary"), ("vocabulary", ["<pad>", 3], "hyper_parameters.vocabulary"),
    ("decoding", {"beam_size": "3"}, "decoding.beam_size"), ("decoder", {"dropout": True}, "decoder.dropout"),
])
def test_a_hyper_parameter_of_the_wrong_type_is_one_line_naming_it(trained_captioner, tmp_path, group, value,
                                                                   named) -> None:
    hparams = torch.load(trained_captioner["ckpt"], weights_only=True)["hyper_parameters"]
    path = altered(trained_captioner["ckpt"], tmp_path / "typed.ckpt", hyper_parameters={**hparams, group: value})
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        load_captioner(path)


def test_a_non_finite_score_is_an_error_naming_the_image_and_no_json_holds_nan(trained_captioner) -> None:
    captioner = load_captioner(trained_captioner["ckpt"])
    with torch.no_grad():
        for parameter in captioner.decoder.parameters():
            parameter.fill_(float("nan"))  # what a finite checkpoint can still meet: an overflow on some input
    image = sorted((trained_captioner["scenes"] / "images" / "test").iterdir())[0]
    with pytest.raises(FloatingPointError, match=image.name):
        caption(captioner, [image])
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json_atomically(trained_captioner["run"] / "never.json", [{"score": float("nan")}])
    assert not (trained_captioner["run"] / "never.json").exists()


def test_every_beam_written_is_a_caption_within_max_length_without_special_tokens(trained_captioner,
                                                                                 tmp_path) -> None:
    out = tmp_path / "beams.json"
    done = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), "--all-beams", "--beam", "50",
                          str(trained_captioner["scenes"] / "images" / "test"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    max_length = load_file(trained_captioner["ckpt"])["hyper_parameters"]["decoding"]["max_length"]
    records = json.loads(out.read_text())  # strict JSON: no NaN or -Infinity scores of dead beams
    for record in records:
        for beam in [record, *record["beams"]]:
            assert len(beam["tokens"]) <= max_length and not set(beam["tokens"]) & (set(SPECIALS) - {"<unk>"})
        assert all(isinstance(beam["score"], float) for beam in record["beams"])


# Each path that reads a checkpoint Lightning resolves by name, with and without a CheckpointIO of the config's
PLUGINS = ["lightning.pytorch.plugins.TorchCheckpointIO", "lightning.pytorch.plugins.AsyncCheckpointIO"]


@pytest.mark.parametrize(("subcommand", "name", "plugin"), [
    ("fit", "last", PLUGINS[0]), ("fit", "last", PLUGINS[1]), ("fit", "last", None), ("fit", "hpc", PLUGINS[0]),
    ("validate", "last", PLUGINS[0]), ("test", "last", PLUGINS[0]), ("predict", "last", PLUGINS[0]),
    ("test", "hpc", None),
])
def test_a_payload_reached_by_name_or_through_a_plugin_is_one_line_and_never_runs(tmp_path, subcommand, name,
                                                                                 plugin) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    _, evil = evil_checkpoints(tmp_path)
    shutil.copy(evil, run / "checkpoints" / "last.ckpt")
    shutil.copy(evil, run / "hpc_ckpt_1.ckpt")
    done = run_in_process(subcommand, *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(run),
                          "--trainer.callbacks.init_args.dirpath", str(run / "checkpoints"), "--ckpt_path", name,
                          *(["--trainer.plugins", plugin] if plugin else []))
    one_line_error(done, "refused")
    assert not (tmp_path / "payload_ran").exists()


def test_a_model_registry_is_refused_in_one_line(tmp_path) -> None:
    for name in ("registry", "registry:my-model"):
        done = run_in_process("test", *tiny("vit_tiny.yaml"), "--ckpt_path", name)
        one_line_error(done, "--ckpt_path", "registry")


def test_a_checkpoints_decoding_options_apply_and_others_are_refused(trained_captioner, tmp_path, caplog) -> None:
    common = ("test", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(trained_captioner["scenes"]),
              "--ckpt_path", str(trained_captioner["ckpt"]), "--trainer.limit_test_batches", "1")
    done = run_in_process(*common, "--model.init_args.decoding.beam_size", "1000000")
    one_line_error(done, "beam_size", "50")
    done = run_in_process(*common, "--model.init_args.decoder.hidden_dim", "64")
    one_line_error(done, "--model.init_args.decoder.hidden_dim: 64, but --ckpt_path", "fitted with 32")
    user = tmp_path / "user.yaml"  # a user's config: an option that differs is said in one line, the checkpoint's used
    user.write_text("model: {init_args: {decoder: {hidden_dim: 32, dropout: 0.5}, objective: "
                    "{doubly_stochastic_weight: 0.5}, encoder: {pretrained: gone.ckpt}}}")
    with caplog.at_level(logging.WARNING, logger="vision_attn.ckpt_path"):
        done = run_in_process(*common, "--config", str(user), "--trainer.default_root_dir", str(tmp_path / "differs"))
    assert done.returncode == 0, done.stderr[-2000:]
    said = [r.getMessage() for r in caplog.records if "config files set 2 model options otherwise" in r.getMessage()]
    assert len(said) == 1 and "model.init_args.decoder.dropout (0.5 there, 0.0 in the checkpoint)" in said[0]
    assert "model.init_args.objective.doubly_stochastic_weight" in said[0] and "hidden_dim" not in said[0]
    assert "dropout: 0.0" in (tmp_path / "differs" / "config.yaml").read_text()  # the checkpoint's, as it ran
    user.write_text("model: {init_args: {decoder: {hidden_dim: 32}, encoder: {pretrained: gone.ckpt}}}")
    done = run_in_process(*common, "--config", str(user), "--model.init_args.encoder.width", "8",
                          "--trainer.default_root_dir", str(tmp_path / "same"))
    assert done.returncode == 0, done.stderr[-2000:]  # the checkpoint's values, and an initial-weight option
    run = tmp_path / "run"
    done = run_in_process(*common, "--model.init_args.decoding.beam_size", "5", "--trainer.default_root_dir",
                          str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "beam_size: 5" in (run / "config.yaml").read_text()
    assert "  limit_test_batches: 1\n" in (run / "config.yaml").read_text()  # one batch when run again from it


def test_a_whole_number_batch_limit_means_batches(tmp_path) -> None:
    config = tmp_path / "limits.yaml"
    config.write_text("trainer: {limit_val_batches: 1, limit_test_batches: 1}\n")
    cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        run=False, auto_configure_optimizers=False, save_config_callback=None,
                        args=[*tiny("vit_tiny.yaml"), "--config", str(config), "--trainer.limit_train_batches", "1",
                              "--trainer.limit_predict_batches", "0.5"])
    trainer = cli.trainer
    assert (trainer.limit_train_batches, trainer.limit_val_batches, trainer.limit_test_batches) == (1, 1, 1)
    assert all(isinstance(limit, int) for limit in (trainer.limit_train_batches, trainer.limit_test_batches))
    assert trainer.limit_predict_batches == 0.5
    saved = yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))["trainer"]  # as config.yaml records it
    assert [saved[f"limit_{stage}_batches"] for stage in ("train", "val", "test", "predict")] == [1, 1, 1, 0.5]
    assert isinstance(saved["limit_train_batches"], int)
    cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        run=False, auto_configure_optimizers=False, save_config_callback=None,
                        args=[*tiny("vit_tiny.yaml"), "--config", str(config), "--trainer.limit_test_batches=1.0"])
    assert cli.trainer.limit_test_batches == 1.0 and isinstance(cli.trainer.limit_test_batches, float)  # all of them
