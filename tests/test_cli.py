"""The real entry point: LightningCLI fit/test with tiny configs, and `classify` through the console script."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import REPO, run_in_process, run_script, shipped, tiny
from vision_attn.data.fashion_mnist import CLASS_NAMES, find_fashion_mnist, load_fashion_mnist


def test_fast_dev_run_through_the_console_script(tmp_path) -> None:
    result = run_script("fit", *tiny("vit_tiny.yaml"), "--trainer.fast_dev_run", "2",
                        "--model.init_args.training.patch_drop_rate", "0.5",  # the default config's PatchDropout
                        "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fast_dev_run" in result.stderr + result.stdout


SHIPPED = {  # each experiment with the bases it is run on, as its header says
    "captioner/fashion_scene_items.yaml": ("trainer/cpu.yaml", "tasks/classifier.yaml"),
    "captioner/fashion_scenes.yaml": ("trainer/cpu.yaml", "tasks/captioner.yaml"),
    "captioner/fashion_scenes_paper.yaml": ("trainer/cpu.yaml", "tasks/captioner.yaml",
                                            "captioner/fashion_scenes.yaml"),
    "captioner/coco_vgg19.yaml": ("trainer/gpu.yaml", "tasks/captioner.yaml", "data/coco.yaml"),
    "captioner/coco_resnet101.yaml": ("trainer/gpu.yaml", "tasks/captioner.yaml", "data/coco.yaml"),
    "vit/fashion_mnist.yaml": ("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml"),
    "vit/fashion_mnist_canvas.yaml": ("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml"),
    "vit/fashion_mnist_teacher.yaml": ("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml"),
    "vit/cifar10.yaml": ("trainer/gpu.yaml", "tasks/classifier.yaml"),
    "vit/imagefolder.yaml": ("trainer/gpu.yaml", "tasks/classifier.yaml"),
}


def test_shipped_configs_parse_with_the_bases_their_header_names() -> None:
    experiments = {str(path.relative_to(REPO / "configs")) for path in (REPO / "configs").rglob("*.yaml")
                   if path.parent.name in ("captioner", "vit")}
    assert experiments == set(SHIPPED)
    for experiment, bases in SHIPPED.items():
        configs = [*bases, experiment]
        header = " ".join(line.lstrip("# ").rstrip("\\ ") for line in
                          (REPO / "configs" / experiment).read_text().split("\ntrainer:")[0].splitlines())
        assert " ".join(f"--config configs/{name}" for name in configs) in " ".join(header.split()), experiment
        result = run_in_process("fit", *shipped(*configs), "--print_config")
        assert result.returncode == 0, f"{experiment}: {result.stderr[-1500:]}"
        assert "class_path: vision_attn.tasks." in result.stdout


def test_no_config_repeats_more_than_ten_lines_of_another() -> None:
    """The configs compose (a trainer, a task, shared data, a short experiment): no two of them, shipped or the
    tests', share more than 10 non-comment lines."""
    import itertools
    from collections import Counter

    def lines(path: Path) -> Counter:
        text = path.read_text().splitlines()
        kept = (line.split(" #")[0].strip() for line in text if not line.lstrip().startswith("#"))
        return Counter(line for line in kept if line)

    configs = sorted((REPO / "configs").rglob("*.yaml")) + sorted((REPO / "tests" / "configs").glob("*.yaml"))
    shared = {(a.name, b.name): sum((lines(a) & lines(b)).values()) for a, b in itertools.combinations(configs, 2)}
    assert max(shared.values()) <= 10, {pair: count for pair, count in shared.items() if count > 10}


def test_test_command_prints_test_accuracy(vit_checkpoint, tmp_path) -> None:
    result = run_in_process("test", *tiny("vit_tiny.yaml"), "--ckpt_path", str(vit_checkpoint),
                        "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "test/acc" in result.stdout


def test_classify_prints_top5_for_images_of_any_mode_and_size(vit_checkpoint, tmp_path) -> None:
    images, labels = load_fashion_mnist(find_fashion_mnist("data/fashion_mnist"), "test")
    grey = tmp_path / "garment.png"
    Image.fromarray(images[0].numpy()).save(grey)
    rgb = tmp_path / "wide.jpg"
    Image.fromarray(np.stack([images[1].numpy()] * 3, -1)).resize((90, 40)).save(rgb)
    out = tmp_path / "classes.json"
    result = run_in_process("classify", "--ckpt", str(vit_checkpoint), str(grey), str(rgb), "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(grey) and lines[6] == str(rgb) and lines[12] == f"wrote the classes of 2 images to {out}"
    probabilities = [float(line.split("%")[0]) for line in lines[1:6]]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 100.01
    assert all(line.split("%", 1)[1].strip() in CLASS_NAMES for line in lines[1:6])
    written = json.loads(out.read_text())  # what was printed, as JSON
    assert [entry["file_name"] for entry in written] == [str(grey), str(rgb)]
    printed = [line for line in lines if "%" in line]
    assert [item["class"] for entry in written for item in entry["top_k"]] == \
        [line.split("%", 1)[1].strip() for line in printed]
    assert [100 * item["probability"] for entry in written for item in entry["top_k"]] == \
        pytest.approx([float(line.split("%")[0]) for line in printed], abs=0.0051)


def test_classify_missing_image_is_one_line_error(vit_checkpoint, tmp_path) -> None:
    result = run_in_process("classify", "--ckpt", str(vit_checkpoint), str(tmp_path / "nope.png"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / 'nope.png'}: no such file or folder"


def test_classify_with_a_non_checkpoint_is_one_line_error(tmp_path) -> None:
    bogus = tmp_path / "model.ckpt"
    bogus.write_text("not a checkpoint")
    result = run_in_process("classify", "--ckpt", str(bogus), str(bogus))
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {bogus}: not a readable PyTorch checkpoint")
    assert "Traceback" not in result.stderr


def test_last_checkpoint_holds_the_final_weights_when_the_last_validation_did_not_improve(tmp_path) -> None:
    """Monitoring val/loss for its *maximum* makes the first validation the best, so Lightning alone writes no
    checkpoint at the later ones and its last.ckpt would stay at step 4; it must hold step 12, the end."""
    import torch

    callbacks = ('[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"dirpath": "'
                 + str(tmp_path / "checkpoints") + '", "filename": "best", "monitor": "val/loss", "mode": "max", '
                 '"save_last": true}}]')
    result = run_in_process("fit", *tiny("vit_tiny.yaml"), "--trainer.max_epochs", "3",
                            "--trainer.callbacks", callbacks, "--trainer.default_root_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    best, last = (torch.load(tmp_path / "checkpoints" / f"{name}.ckpt", map_location="cpu", weights_only=False)
                  for name in ("best", "last"))
    assert best["global_step"] == 4 and last["global_step"] == 12  # 3 epochs of 4 batches
    assert not torch.equal(best["state_dict"]["model.head.weight"], last["state_dict"]["model.head.weight"])


def test_the_cli_paces_lightnings_default_progress_bar_and_keeps_a_configured_one(tmp_path) -> None:
    """Lightning's default bar is redrawn at every batch (~2 ms of a 30 ms CPU step); the CLI puts a bar in its
    place that is redrawn at most every 0.2 s and at each bar's end. A bar given in the config, or none
    (``enable_progress_bar: false``), is left as configured."""
    import time

    import lightning as L
    from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

    from vision_attn.trainer_callbacks import PacedProgressBar
    from vision_attn.trainer_cli import VisionAttnCLI

    def cli_with(*overrides: str) -> VisionAttnCLI:
        return VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                             subclass_mode_data=True, run=False, auto_configure_optimizers=False,
                             save_config_callback=None,
                             args=[*tiny("vit_tiny.yaml"), "--trainer.default_root_dir",
                                   str(tmp_path), "--trainer.logger", "false", *overrides])

    def bars(cli: VisionAttnCLI) -> list[ProgressBar]:
        return [callback for callback in cli.trainer.callbacks if isinstance(callback, ProgressBar)]

    cli = cli_with("--trainer.enable_progress_bar", "true")
    [paced] = bars(cli)
    assert type(paced) is PacedProgressBar
    [configured] = bars(cli_with("--trainer.enable_progress_bar", "true", "--trainer.callbacks",
                                 '[{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar"}]'))
    assert type(configured) is TQDMProgressBar and configured.refresh_rate == 1
    assert bars(cli_with("--trainer.enable_progress_bar", "false")) == []

    # the batches of an endless epoch, through the bar's public hook: the bar shows a batch when it is drawn
    paced.train_progress_bar = paced.init_train_tqdm()
    paced.train_progress_bar.total = 10**9
    drawn, start = [], time.monotonic()
    while time.monotonic() - start < 0.5:  # thousands of batches in half a second: about 3 redraws
        paced.on_train_batch_end(cli.trainer, cli.model, None, None, len(drawn))
        drawn.append(paced.train_progress_bar.n == len(drawn) + 1)
    assert drawn[0] and 2 <= sum(drawn) <= 4 and len(drawn) > 100
    paced.on_train_batch_end(cli.trainer, cli.model, None, None, 10**9 - 1)
    assert paced.train_progress_bar.n == 10**9  # the bar's last batch is always drawn


def test_a_fit_under_max_time_stops_at_a_validation_that_leaves_less_time_than_it_took() -> None:
    """Validations of 1 s every 10 steps of 10 ms, max_time 3 s. The first ends at ~1.1 s (1.9 s left: go on), the
    second at ~2.2 s (0.8 s left, less than it took): with the budget's last 30% as the tail, the fit stops
    there, at step 20, inside its 3 s. With the default tail (5%, 0.15 s here) it does not: it trains on and
    validates at step 30 (to ~3.3 s, past max_time), and from there Lightning's own stop follows (a step, a
    fourth validation). Delays only shorten the time left; 0.8 s of them would be needed to turn the stop into
    going on."""
    import time
    from datetime import timedelta

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from vision_attn.tasks.schedule import RunSchedule
    from vision_attn.trainer_cli import VisionAttnCLI

    class Sleepy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer, self.validations = torch.nn.Linear(1, 1), 0

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            time.sleep(0.01)
            return self.layer(batch[0]).square().mean()

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            time.sleep(1.0)

        def on_validation_end(self) -> None:
            self.validations += 1

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(callback: RunSchedule) -> tuple[Sleepy, L.Trainer, float]:
        data = DataLoader(TensorDataset(torch.zeros(10_000, 1)), batch_size=1)
        model = Sleepy()
        trainer = L.Trainer(max_time=timedelta(seconds=3), val_check_interval=10, limit_val_batches=1,
                            num_sanity_val_steps=0, callbacks=[callback], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        start = time.monotonic()
        trainer.fit(model, data, DataLoader(TensorDataset(torch.zeros(1, 1))))
        return model, trainer, time.monotonic() - start

    model, trainer, took = fit(RunSchedule(tail=0.3))
    assert model.validations == 2 and trainer.global_step == 20 and took < 3.0
    model, trainer, took = fit(RunSchedule())
    assert model.validations >= 3 and trainer.global_step > 20 and took > 3.0

    cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        run=False, auto_configure_optimizers=False, save_config_callback=None,
                        args=[*tiny("vit_tiny.yaml"), "--trainer.logger", "false",
                              "--trainer.max_time", "00:00:01:00"])
    # every task brings the one schedule along: it is the callback that stops at the last validation
    assert [callback for callback in cli.model.configure_callbacks() if isinstance(callback, RunSchedule)] == \
        [cli.model.schedule]


def test_predict_is_a_lightning_command_that_needs_a_checkpoint() -> None:
    """`predict` is listed with the Lightning commands and has LightningCLI's options; without --ckpt_path it is
    refused in one line (it would predict with untrained weights). tests/test_portable_checkpoint.py runs it."""
    helped = run_in_process("--help")
    assert re.search(r"^  predict\s+predict the test split", helped.stdout, flags=re.MULTILINE), helped.stdout
    assert "--ckpt_path" in run_in_process("predict", "--help").stdout
    result = run_in_process("predict", "--config", str(REPO / "tests" / "configs" / "vit_tiny.yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: predict needs --ckpt_path")


def test_a_null_given_on_the_command_line_reaches_a_nested_option_as_null() -> None:
    """`--model.init_args.decoder.compile null` turns the COCO recipes' compiled decoder off (their eager path,
    one option away), and `encoder.pretrained=null` drops their ImageNet weights: nulls, not the string 'None';
    the groups' other options keep the config's values."""
    from vision_attn.cli_arguments import nulls_to_groups

    base = shipped(*SHIPPED["captioner/coco_vgg19.yaml"], "captioner/coco_vgg19.yaml")
    recipe = run_in_process("fit", *base, "--print_config")
    assert recipe.returncode == 0, recipe.stderr[-1500:]
    assert "compile: reduce-overhead" in recipe.stdout and "pretrained: imagenet" in recipe.stdout
    result = run_in_process("fit", *base, "--model.init_args.decoder.compile", "null",
                            "--model.init_args.encoder.pretrained=null", "--print_config")
    assert result.returncode == 0, result.stderr[-1500:]
    assert "compile: null" in result.stdout and "pretrained: null" in result.stdout and "None" not in result.stdout
    assert "trainable_stages: 0" in result.stdout and "dropout: 0.5" in result.stdout  # the rest of each group
    kept = ["--model.init_args.decoder.compile", "default", "--trainer.logger", "null", "--data.root", "null"]
    assert nulls_to_groups(kept) == kept  # other values, and nulls of options that are no group's, pass as given
