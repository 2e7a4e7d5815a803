"""Faults: a run killed with SIGKILL resumes exactly; a diverged loss stops cleanly; writes are atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import CONFIGS, REPO, console_script, run_in_process, tiny
from vision_attn.checkpoint import load_file
from vision_attn.io import replace_atomically, write_json_atomically

STEPS_PER_EPOCH, EPOCHS = 10, 3


def resume_config(tmp_path: Path, name: str, *, slow: bool) -> tuple[Path, Path]:
    """The resume test config with its own checkpoint folder, optionally slowed down so it can be killed."""
    checkpoints = tmp_path / name / "checkpoints"
    text = (CONFIGS / "vit_resume.yaml").read_text().replace("dirpath: checkpoints ", f"dirpath: {checkpoints} ")
    if slow:
        text = text.replace("  callbacks:\n", "  callbacks:\n    - class_path: tests.helpers.SlowSteps\n"
                                              "      init_args:\n        seconds: 0.3\n", 1)
    config = tmp_path / f"{name}.yaml"
    config.write_text(text)
    return config, checkpoints


def fit(config: Path, root: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([console_script(), "fit", *tiny("vit_tiny.yaml", config), "--trainer.default_root_dir",
                                str(root), *extra], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    if wait:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    return process


def global_step(checkpoint: Path) -> int:
    try:
        return int(load_file(checkpoint)["global_step"])
    except Exception:  # noqa: BLE001 - not written yet
        return -1


@pytest.mark.heavy
def test_a_run_killed_mid_epoch_resumes_to_bitwise_the_same_weights(tmp_path) -> None:
    # The uninterrupted run in this process (it saves a second start of Python, torch and Lightning), the killed
    # and the resumed ones as a user runs them.
    straight_config, straight_checkpoints = resume_config(tmp_path, "straight", slow=False)
    straight_run = run_in_process("fit", *tiny("vit_tiny.yaml", straight_config), "--trainer.default_root_dir",
                                  str(tmp_path / "straight"))
    assert straight_run.returncode == 0, straight_run.stderr[-3000:]

    killed_config, killed_checkpoints = resume_config(tmp_path, "killed", slow=True)
    process = fit(killed_config, tmp_path / "killed", wait=False)
    last = killed_checkpoints / "last.ckpt"
    deadline = time.monotonic() + 300
    while global_step(last) < STEPS_PER_EPOCH + 4:  # well inside the second epoch
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached the step to kill it at"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    killed_at = global_step(last)
    assert killed_at % STEPS_PER_EPOCH != 0, "killed on an epoch boundary; the test wants the middle of one"

    resumed_config, _ = resume_config(tmp_path, "killed", slow=False)  # same folder, no more slowing down
    fit(resumed_config, tmp_path / "killed", "--ckpt_path", "last")

    straight, resumed = load_file(straight_checkpoints / "last.ckpt"), load_file(last)
    assert straight["global_step"] == resumed["global_step"] == STEPS_PER_EPOCH * EPOCHS
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    for name, tensor in straight["state_dict"].items():
        assert torch.equal(tensor, resumed["state_dict"][name]), f"{name} differs after the resume"
    for a, b in zip(straight["optimizer_states"][0]["state"].values(),
                    resumed["optimizer_states"][0]["state"].values(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_a_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(tmp_path) -> None:
    config, checkpoints = resume_config(tmp_path, "nan", slow=False)
    result = run_in_process("fit", *tiny("vit_tiny.yaml", config), "--trainer.default_root_dir", str(tmp_path / "nan"),
                            "--model.init_args.optimiser.lr", "1e30", "--model.init_args.optimiser.weight_decay", "0")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "training loss is nan" in errors[0] or "training loss is inf" in errors[0]
    stopped_at = int(errors[0].split(" at step ")[1].split(";")[0])
    last = load_file(checkpoints / "last.ckpt")
    assert last["global_step"] == stopped_at  # the last step that finished, written whole
    assert all(torch.isfinite(tensor).all() for tensor in last["state_dict"].values() if tensor.is_floating_point())


def test_atomic_writes_leave_the_old_file_whole_when_writing_fails(tmp_path) -> None:
    target = tmp_path / "results.json"
    write_json_atomically(target, [{"image_id": 1, "caption": "a cat"}])
    before = target.read_bytes()

    def crash(file) -> None:  # noqa: ANN001
        file.write(b'[{"image_id": 1, "capt')
        raise KeyboardInterrupt  # as if the process were interrupted mid-write

    with pytest.raises(KeyboardInterrupt):
        replace_atomically(target, crash)
    assert target.read_bytes() == before
    assert list(tmp_path.iterdir()) == [target]  # no temporary file left behind either


def test_the_resumable_sampler_is_a_fixed_permutation_per_epoch_that_can_start_part_way() -> None:
    from vision_attn.datamodules.split_datamodule import ResumableRandomSampler

    sampler = ResumableRandomSampler(50, seed=3)
    epoch0, epoch0_again = list(sampler), list(sampler)
    assert sorted(epoch0) == list(range(50)) and epoch0 == epoch0_again
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert sorted(epoch1) == list(range(50)) and epoch1 != epoch0
    sampler.resume_at = (1, 20)  # 20 items of epoch 1 were trained on before the crash
    assert list(sampler) == epoch1[20:] and len(sampler) == 50
    assert list(sampler) == epoch1  # the skip applies once
    sampler.resume_at = (0, 20)  # a checkpoint from an epoch that had finished: nothing to skip in epoch 1
    assert list(sampler) == epoch1


def test_evaluation_shards_cover_every_item_once() -> None:
    from vision_attn.datamodules.split_datamodule import ShardedEvalSampler

    dataset = list(range(11))
    shards = []
    for rank in range(3):
        sampler = ShardedEvalSampler(dataset, num_replicas=3, rank=rank)
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    assert sorted(i for shard in shards for i in shard) == dataset
