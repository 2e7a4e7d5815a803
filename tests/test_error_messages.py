"""Error messages that name their cause in one line: ``error: ...`` on stderr and exit 2, naming the file or the
option, never a usage block, a class dump or torch's advice to load with ``weights_only=False``.

Each case runs through the real entry point (``vision_attn.cli.main`` in-process; the Hugging Face cases in a
fresh interpreter, since huggingface_hub reads ``HF_HOME`` when imported), on files written here: config files
with typos or broken content, weights that are damaged or for another architecture at the exact cache paths
torchvision and timm read, and a feature cache whose shard or ``key.json`` was damaged or edited.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import REPO, run_each_in_a_fresh_process, run_in_process, tiny
from tests.test_pretrained_weights import fill_hub_cache, fresh_environment
from vision_attn.checkpoint import load_file, load_weights
from vision_attn.datamodules import CocoCaptionsDataModule
from vision_attn.errors import CheckpointError

CAPTIONER = tiny("captioner_tiny.yaml")
RESNET50_FILE = "resnet50-11ad3fa6.pth"  # torchvision's ResNet50_Weights.IMAGENET1K_V2, as torch.hub names it


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    """The tiny scenes set of ``captioner_tiny.yaml`` (24/6/6 images), generated once."""
    root = tmp_path_factory.mktemp("error_scenes") / "scenes"
    CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": {"train": 24, "val": 6, "test": 6}})
    return root


def the_error(result, *, logs_allowed: bool = False) -> str:
    """The one line of a refused command: exit 2, one ``error:`` line, no traceback, no warning; with
    ``logs_allowed`` the run's INFO log lines (the seed) may come before it."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "weights_only" not in result.stderr, result.stderr[-3000:]
    if logs_allowed:
        lines = [line for line in lines if not line.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


# --- the chain of a re-raised error ----------------------------------------------------------------------


def test_a_message_raised_from_none_stands_over_the_inner_error_it_replaced(scenes, tmp_path) -> None:
    """str.format's "Single '{' encountered" is raised inside our check, which replaces it `from None` with the
    option's name: that is the line shown, not the inner one."""
    result = run_in_process("fit", *CAPTIONER, "--data.init_args.root", str(scenes),
                            "--data.init_args.layout.captions_file_pattern", "annotations/{",
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result, logs_allowed=True) == (
        "error: layout.captions_file_pattern 'annotations/{' may only contain the placeholder {split}")


# --- LightningCLI: options and config files ------------------------------------------------------------------


@pytest.mark.parametrize("arguments, expected", [
    (["--model.init_args.lerning_rate", "0.1"], "error: --model.init_args.lerning_rate: no such option of "
     "vision_attn.tasks.CaptionerTask; did you mean --model.init_args.optimiser.lr?"),
    (["--trainer.max_epocks", "1"], "error: --trainer.max_epocks: no such option; did you mean --trainer.max_epochs?"),
    (["--data.init_args.loader.batchsize", "3"], "error: --data.init_args.loader.batchsize: no such option of "
     "vision_attn.datamodules.CocoCaptionsDataModule; did you mean --data.init_args.loader.batch_size?"),
    (["--ckpt_pth", "x.ckpt"], "error: --ckpt_pth: no such option; did you mean --ckpt_path?"),
    (["--trainer.max_epochs", "abc"], "error: --trainer.max_epochs: expected int, got abc"),
    (["--model.init_args.decoder.attention_mode", "sofft"],
     "error: --model.init_args.decoder.attention_mode: expected one of 'soft', 'hard', got sofft"),
    (["--model", "vision_attn.tasks.CaptionerTsk"], "error: --model: class_path vision_attn.tasks.CaptionerTsk: "
     "module 'vision_attn.tasks' has no attribute 'CaptionerTsk'"),
    (["--model.lr", "0.1"], "error: --model.lr: no such option of vision_attn.tasks.CaptionerTask; did you mean "
     "--model.init_args.optimiser.lr?"),
    (["--model.init_args.decoder", '{"attention_mod": "soft"}'], "error: --model.init_args.decoder.attention_mod: "
     "no such option of vision_attn.tasks.CaptionerTask; did you mean --model.init_args.decoder.attention_mode?"),
    (["--seed_everything", "abc"], "error: --seed_everything: abc is not a value it takes; `vision-attn fit --help` "
     "lists the options"),
], ids=["model_option", "trainer_option", "data_group_option", "command_option", "bad_int", "bad_choice",
        "bad_class", "option_in_another_group", "option_of_a_group_given_whole", "bad_seed"])
def test_an_option_lightningcli_refuses_is_one_line_with_the_closest_option(arguments, expected, tmp_path) -> None:
    result = run_in_process("fit", *CAPTIONER, *arguments, "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result) == expected
    assert not (tmp_path / "run").exists()


def test_a_refused_inline_value_longer_than_a_file_name_is_one_line(tmp_path) -> None:
    """A mapping given inline to --model that jsonargparse refuses, longer than a file name may be (255): it is
    looked at as a possible config file first, which must not raise OSError (a traceback) but name the option."""
    value = "{decoder: {hidden_dim: " + "x" * 300 + "}}"
    result = run_in_process("fit", *CAPTIONER, "--model", value, "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result) == f"error: --model.decoder.hidden_dim: expected int, got {'x' * 300}"
    assert not (tmp_path / "run").exists()


def test_the_captioning_data_has_no_default_dataset_a_config_must_name_its_root(tmp_path) -> None:
    result = run_in_process("fit", "--config", str(REPO / "configs" / "tasks" / "captioner.yaml"),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result).endswith("class_path vision_attn.datamodules.CocoCaptionsDataModule: the following "
                                      "arguments are required: root")
    assert not (tmp_path / "run").exists()


def test_a_wrong_extension_is_one_line_before_the_data_is_drawn(tmp_path) -> None:
    """The option groups are checked before the DataModule is built: the scenes it would draw are never drawn."""
    result = run_in_process("fit", *(arg for name in ("trainer/cpu.yaml", "tasks/captioner.yaml",
                                                      "captioner/fashion_scenes.yaml")
                                     for arg in ("--config", str(REPO / "configs" / name))),
                            "--model.init_args.decoding.processors", "[{name: forbiden_words}]",
                            "--data.init_args.root", str(tmp_path / "scenes"),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result) == ("error: decoding.processors: unknown extension 'forbiden_words'; did you mean "
                                 "forbidden_words?")
    assert not (tmp_path / "scenes").exists() and not (tmp_path / "run").exists()


def test_a_mistyped_command_suggests_the_closest() -> None:
    assert the_error(run_in_process("fitt", *CAPTIONER)) == "error: fitt: no such command; did you mean fit?"


CONFIGS = {
    "top_level_typo": (b"trainr:\n  max_epochs: 1\n", "no option trainr.max_epochs; did you mean trainer.max_epochs?"),
    "model_typo": (b"model:\n  init_args:\n    lerning_rate: 0.1\n", "no option model.init_args.lerning_rate of "
                   "vision_attn.tasks.CaptionerTask; did you mean model.init_args.optimiser.lr?"),
    "bad_value": (b"trainer:\n  max_epochs: abc\n", "trainer.max_epochs: expected int, got abc"),
    "binary": (bytes(range(256)) * 4, "not a YAML config file, byte 128 is not UTF-8 text (a binary file?)"),
    "empty": (b"# nothing but a comment\n", "the config file is empty; it holds options such as trainer:, model: "
              "and data:"),
    "python_tag": (b"trainer: !!python/object/apply:os.system [touch {marker}]\n", "line 1, column 10: the YAML tag "
                   "!!python/object/apply:os.system is refused: a config holds plain values (classes are named by "
                   "class_path and init_args)"),
    "broken_yaml": (b"trainer:\n  max_epochs: [1\n", "not valid YAML, line 3, column 1: expected ',' or ']', but "
                    "got '<stream end>'"),
    "a_list": (b"- trainer\n- model\n", "a config file holds a mapping of options (trainer:, model:, data:), not a "
               "list"),
    "missing": (None, "no such file; --config takes a YAML config file"),
}


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_broken_or_mistyped_config_file_is_one_line_naming_it(kind, tmp_path) -> None:
    content, expected = CONFIGS[kind]
    config, marker = tmp_path / f"{kind}.yaml", tmp_path / "marker"
    if content is not None:
        config.write_bytes(content.replace(b"{marker}", str(marker).encode()))
    result = run_in_process("fit", *CAPTIONER, "--config", str(config), "--trainer.default_root_dir",
                            str(tmp_path / "run"))
    assert the_error(result) == f"error: {config}: {expected}"
    assert not marker.exists() and not (tmp_path / "run").exists()  # nothing ran, nothing was written


def test_help_and_print_config_still_print_in_full(tmp_path) -> None:
    shown = run_in_process("fit", "--help")
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr[-2000:]
    assert "--trainer.max_epochs" in shown.stdout and "--ckpt_path" in shown.stdout
    assert len(shown.stdout.splitlines()) > 100
    printed = run_in_process("fit", *CAPTIONER, "--trainer.max_epochs", "7", "--print_config")
    assert printed.returncode == 0 and printed.stderr == "", printed.stderr[-2000:]
    config = yaml.safe_load(printed.stdout)
    assert config["trainer"]["max_epochs"] == 7 and config["model"]["class_path"] == "vision_attn.tasks.CaptionerTask"
    assert config["model"]["init_args"]["optimiser"]["lr"] > 0


def test_our_option_groups_keep_their_own_one_line(scenes, tmp_path) -> None:
    result = run_in_process("fit", *CAPTIONER, "--data.init_args.root", str(scenes),
                            "--data.init_args.loader.batch_size", "-3", "--trainer.default_root_dir", str(tmp_path))
    assert the_error(result, logs_allowed=True) == "error: loader.batch_size must be at least 1, got -3"


# --- pretrained weights at the libraries' cache paths ------------------------------------------------------------


def _truncated(folder: Path) -> bytes:
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, folder / "whole.pt")
    data = (folder / "whole.pt").read_bytes()
    return data[: len(data) // 2]


TORCH_HUB_FILES = {  # what each file holds (written under the test's folder) and how the error starts
    "pickle_garbage": (lambda _: b"\x80" + bytes(range(58, 250)) * 8,
                       "not a readable PyTorch checkpoint, truncated or damaged (byte 2 of its pickle is no pickle "
                       "opcode)"),
    "random_bytes": (lambda _: bytes(range(256)) * 8,
                     "not a readable PyTorch checkpoint (neither a zip archive nor a pickle)"),
    "truncated": (_truncated, "not a readable PyTorch checkpoint, truncated or damaged ("),
    "empty": (lambda _: b"", "not a PyTorch checkpoint, the file is empty"),
}


@pytest.mark.parametrize("kind", list(TORCH_HUB_FILES))
def test_damaged_torchvision_weights_in_the_torch_hub_cache_are_one_line_naming_the_file(kind, scenes, tmp_path,
                                                                                         monkeypatch) -> None:
    content, expected = TORCH_HUB_FILES[kind]
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = tmp_path / "torch" / "hub" / "checkpoints" / RESNET50_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(content(tmp_path))
    result = run_in_process("fit", *CAPTIONER, "--data.init_args.root", str(scenes),
                            "--model.init_args.encoder.backbone", "resnet50",
                            "--model.init_args.encoder.pretrained", "imagenet",
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    line = the_error(result, logs_allowed=True)
    assert line.startswith(f"error: {cached}: {expected}"), line
    assert line.endswith(f"delete it and put the file from https://download.pytorch.org/models/{RESNET50_FILE} there")


@pytest.mark.parametrize("state, expected", [
    ({"conv1.weight": torch.zeros(8, 3, 3, 3)}, "conv1.weight is (8, 3, 3, 3) in the file but (64, 3, 7, 7) in the "
     "trunk"),
    ({"conv1.weight": torch.zeros(64, 3, 7, 7)}, "of the trunk's weights are not in the file, e.g. 0.1.weight"),
    ({"features.0.weight": torch.zeros(64, 3, 3, 3)}, "none of its keys matches the trunk's"),
], ids=["other_shape", "too_few", "other_names"])
def test_torchvision_weights_of_another_architecture_name_the_file_and_the_first_mismatch(state, expected, scenes,
                                                                                          tmp_path,
                                                                                          monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cached = tmp_path / "torch" / "hub" / "checkpoints" / RESNET50_FILE
    cached.parent.mkdir(parents=True)
    torch.save(state, cached)
    result = run_in_process("fit", *CAPTIONER, "--data.init_args.root", str(scenes),
                            "--model.init_args.encoder.backbone", "resnet50",
                            "--model.init_args.encoder.pretrained", "imagenet",
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    line = the_error(result, logs_allowed=True)
    assert line.startswith(f"error: {cached} (torchvision ResNet50_Weights.IMAGENET1K_V2): weights for another "
                           "architecture than the resnet50 trunk, "), line
    assert expected in line, line


def test_damaged_or_foreign_timm_weights_in_the_hugging_face_cache_name_the_file(scenes, tmp_path) -> None:
    hub = tmp_path / "hf" / "hub"
    resnet = fill_hub_cache(hub, "timm/resnet18.a1_in1k", {"unused": torch.zeros(1)})
    resnet.write_bytes(b"\xff" * 64)  # not a safetensors header
    vit = fill_hub_cache(hub, "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", {"cls_token": torch.zeros(1, 1, 8)})
    commands = [["fit", *CAPTIONER, "--data.init_args.root", str(scenes), "--model.init_args.encoder.backbone",
                 "timm:resnet18", "--model.init_args.encoder.pretrained", "imagenet",
                 "--trainer.default_root_dir", str(tmp_path / "run1")],
                ["fit", *tiny("vit_tiny.yaml"), "--model.init_args.pretrained", "timm:vit_tiny_patch16_224",
                 "--trainer.default_root_dir", str(tmp_path / "run2")]]
    # one fresh interpreter: huggingface_hub reads HF_HOME when it is imported
    outcomes = run_each_in_a_fresh_process(commands, env=fresh_environment(tmp_path, offline=True))
    for outcome in outcomes:
        errors = [line for line in outcome.stderr.splitlines() if not line.startswith("INFO")]
        assert outcome.returncode == 2 and len(errors) == 1, outcome.stderr[-3000:]
        assert "Traceback" not in outcome.stderr and "weights_only" not in outcome.stderr
    damaged, foreign = (outcome.stderr.strip().splitlines()[-1] for outcome in outcomes)
    assert damaged.startswith(f"error: {resnet}: not a readable safetensors file, truncated or damaged ("), damaged
    assert foreign.startswith(f"error: {vit}: not timm vit_tiny_patch16_224.augreg_in21k_ft_in1k: weights for another "
                              "architecture, cls_token is (1, 1, 8) in the file but (1, 1, 192) in the model"), foreign
    assert str(REPO) not in damaged  # the cache under tmp_path was read, not a file of the checkout


def test_what_is_wrong_with_a_checkpoint_is_told_from_the_file_and_the_model(tmp_path) -> None:
    """Without torch's words: a legacy-format file cut short is found so by reading its pickles' opcodes (torch
    itself fails there with a struct.error, an IndexError or an EOFError), and weights for another architecture
    by comparing them with the model's own state dict."""
    legacy = tmp_path / "legacy.pt"
    torch.save({"weight": torch.zeros(3)}, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    for cut in (20, len(data) // 2):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"cut\.pt: not a readable PyTorch checkpoint, truncated or "
                                                  r"damaged \(its pickle ends early\)$"):
            load_file(tmp_path / "cut.pt")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match=r"^w\.pt: weights do not fit Linear: weights for another architecture, "
                                              r"weight is \(2, 4\) in the file but \(2, 3\) in the model$"):
        load_weights(model, {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}, source="w.pt")
    with pytest.raises(CheckpointError, match=r"\(1 missing keys, e\.g\. bias; 1 unexpected keys, e\.g\. extra\)$"):
        load_weights(model, {"weight": torch.zeros(2, 3), "extra": torch.zeros(1)}, source="w.pt")
    assert load_weights(model, {"weight": torch.ones(2, 3), "bias": torch.ones(2)}, source="w.pt") is model
    assert bool((model.weight == 1).all())


# --- the feature cache --------------------------------------------------------------------------------------


def cache_arguments(scenes: Path, cache: Path) -> list[str]:
    return [*CAPTIONER, "--data.init_args.root", str(scenes), "--model.init_args.encoder.trainable_stages", "0",
            "--data.init_args.feature_cache.folder", str(cache)]


@pytest.fixture(scope="module")
def filled_cache(scenes, tmp_path_factory) -> Path:
    """The tiny captioner's feature cache of the three splits (one shard each), filled once by cache-features;
    each test damages a copy."""
    cache = tmp_path_factory.mktemp("filled") / "cache"
    filled = run_in_process("cache-features", *cache_arguments(scenes, cache))
    assert filled.returncode == 0 and "(3 of 3 shards to fill)" in filled.stdout, filled.stderr[-3000:]
    return cache


def split_folder(cache: Path, count: int) -> Path:
    """The cache folder of the split of ``count`` images (24: train)."""
    return next(key.parent for key in cache.glob("*/key.json")
                if json.loads(key.read_text()).get("count") == count)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_damaged_with_nan_is_one_line_naming_it_not_a_nan_loss(workers, scenes, filled_cache,
                                                                      tmp_path) -> None:
    """Read in the main process or in a DataLoader worker (whose error arrives wrapped with its traceback)."""
    cache = tmp_path / "cache"
    shutil.copytree(filled_cache, cache)
    shard = split_folder(cache, 24) / "shard_00000.npy"
    features = np.load(shard)
    features[5] = np.nan  # one image's features: the shard is read whole once, checked once
    np.save(shard, features)
    result = run_in_process("fit", *cache_arguments(scenes, cache), "--trainer.num_sanity_val_steps", "0",
                            "--data.init_args.loader.num_workers", str(workers),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert the_error(result, logs_allowed=True) == (
        f"error: {shard}: holds non-finite values (NaN or infinity), which a fill never writes: the shard was "
        "damaged after it was written; delete it and the next fit or cache-features fills it again")
    assert not list((tmp_path / "run").rglob("*.ckpt"))


@pytest.mark.parametrize("damage", ["edited", "binary", "deleted"])
def test_a_changed_key_json_makes_its_shards_stale_and_the_count_printed_is_the_count_filled(
        damage, scenes, filled_cache, tmp_path, caplog) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(filled_cache, cache)
    key = split_folder(cache, 24) / "key.json"
    times = {path: path.stat().st_mtime_ns for path in cache.rglob("shard_*")}
    if damage == "edited":
        key.write_text(key.read_text().replace('"image_size": 96', '"image_size": 97'))
    elif damage == "binary":
        key.write_bytes(bytes(range(256)))
    else:
        key.unlink()
    with caplog.at_level(logging.WARNING, logger="vision_attn.data.feature_cache"):
        again = run_in_process("cache-features", *cache_arguments(scenes, cache))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "(1 of 3 shards to fill)" in again.stdout
    warned = [record.getMessage() for record in caplog.records if "stale" in record.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(str(key)), warned
    rewritten = {path for path, mtime in times.items() if path.stat().st_mtime_ns != mtime}
    assert rewritten == {key.parent / "shard_00000.npy", key.parent / "shard_00000.valid.npy"}
    assert "(0 of 3 shards to fill)" in run_in_process("cache-features", *cache_arguments(scenes, cache)).stdout
