"""Nothing we load can run code: checkpoints with pickled payloads are refused, and the payload never runs."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from vision_attn.checkpoint import CheckpointError, load_file
from vision_attn.cli import main


class Payload:
    """Unpickling this calls os.system, which would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def evil_checkpoints(folder: Path) -> list[Path]:
    """The payload as a plain pickle, inside a torch zip checkpoint, and inside a Lightning-shaped dict."""
    marker = folder / "payload_ran"
    plain = folder / "plain.pth"
    with open(plain, "wb") as file:
        pickle.dump({"state_dict": {"w": Payload(marker)}}, file)
    zipped = folder / "zipped.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hyper_parameters": {"x": Payload(marker)},
                "vision_attn_kind": "vit"}, zipped)
    assert zipfile.is_zipfile(zipped)
    return [plain, zipped]


def test_a_pickle_payload_is_refused_and_never_runs(tmp_path, capsys) -> None:
    image = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    for evil in evil_checkpoints(tmp_path):
        with pytest.raises(CheckpointError, match="refused"):
            load_file(evil)
        for command in (["classify", "--ckpt", str(evil), str(image)], ["caption", "--ckpt", str(evil), str(image)],
                        ["overlay", "--ckpt", str(evil), str(image), "--out", str(tmp_path / "o")]):
            with pytest.raises(SystemExit):
                main(command)
            stderr = capsys.readouterr().err
            assert stderr.startswith("error: ") and "refused" in stderr and "Traceback" not in stderr
        assert not (tmp_path / "payload_ran").exists()


def test_a_pickle_payload_given_as_ckpt_path_is_refused_before_lightning_reads_it(tmp_path, capsys) -> None:
    from tests.conftest import CONFIGS

    _, zipped = evil_checkpoints(tmp_path)
    with pytest.raises(SystemExit):
        main(["test", "--config", str(CONFIGS / "vit_tiny.yaml"), "--ckpt_path", str(zipped),
              "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "refused" in capsys.readouterr().err
    assert not (tmp_path / "payload_ran").exists()
