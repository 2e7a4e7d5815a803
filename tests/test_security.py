"""Nothing we load can run code: checkpoints with pickled payloads are refused, and the payload never runs."""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import pickle
import threading
import zipfile
from collections.abc import Iterator
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
    from tests.conftest import tiny

    _, zipped = evil_checkpoints(tmp_path)
    with pytest.raises(SystemExit):
        main(["test", *tiny("vit_tiny.yaml"), "--ckpt_path", str(zipped),
              "--trainer.default_root_dir", str(tmp_path / "run")])
    assert "refused" in capsys.readouterr().err
    assert not (tmp_path / "payload_ran").exists()


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 serving ``folder`` (bounded: it stops with the block); yields its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def unsafe_ckpt(folder: Path) -> Path:
    """A checkpoint whose top level carries the payload (Lightning's weights_only=False load would run it)."""
    path = folder / "evil.ckpt"
    payload = Payload(folder / "payload_ran")
    torch.save({"state_dict": {}, "hyper_parameters": {}, "vision_attn_kind": "vit", "x": payload}, path)
    return path


@pytest.mark.parametrize("scheme", ["http", "file", "fsspec"])
def test_a_remote_or_uri_ckpt_path_never_runs_code(scheme: str, tmp_path: Path, capsys) -> None:
    from tests.conftest import tiny

    evil = unsafe_ckpt(tmp_path)
    with serving(tmp_path) as url:
        location = {"http": f"{url}/{evil.name}", "file": evil.as_uri(), "fsspec": f"simplecache::{url}/{evil.name}"}
        with pytest.raises(SystemExit) as exit_info:
            main(["test", *tiny("vit_tiny.yaml"), "--ckpt_path", location[scheme],
                  "--trainer.default_root_dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("error: ") and "Traceback" not in err
        assert ("refused" if scheme == "file" else "remote checkpoints") in err
        for command in (["classify", "--ckpt", location[scheme], str(evil)],
                        ["caption", "--ckpt", location[scheme], str(evil)]):
            with pytest.raises(SystemExit):
                main(command)
            assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "payload_ran").exists()


def test_load_from_checkpoint_and_pretrained_weights_refuse_remote_paths(tmp_path: Path) -> None:
    from vision_attn.tasks import ViTTask

    evil = unsafe_ckpt(tmp_path)
    with serving(tmp_path) as url:
        for location in (f"{url}/{evil.name}", evil, evil.as_uri()):
            with pytest.raises(CheckpointError):
                ViTTask.load_from_checkpoint(location)
            with pytest.raises(CheckpointError):
                ViTTask(pretrained=str(location))
    assert not (tmp_path / "payload_ran").exists()


def test_a_folder_or_a_pipe_as_checkpoint_is_named_for_what_it_is(tmp_path: Path) -> None:
    pipe = tmp_path / "pipe.ckpt"
    os.mkfifo(pipe)
    with pytest.raises(CheckpointError, match="is a folder"):
        load_file(tmp_path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_file(pipe)
