"""Shared helpers and fixtures for the tests: the console script, and tiny trained checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from vision_attn.cli import main

CONFIGS = Path(__file__).parent / "configs"
REPO = Path(__file__).resolve().parents[1]

# The suite's temporary files at their peak (a passed test's tmp_path is removed when it ends), measured by
# sampling `du` of pytest's base folder every 3 s through `make test`: 1.7 GB. With under 2 GiB free the run
# stops at once with one line, instead of failing half its tests on "No space left on device".
TMP_NEEDED_GIB = float(os.environ.get("VISION_ATTN_TEST_TMP_GIB", "2"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests marked ``heavy`` (each tens of seconds under scripts/slower_cpu.sh) first, in their order.
    ``make test`` hands tests to its two workers two at a time (``--dist load --maxschedchunk 2``), so the heavy
    ones spread over both from the start and the run ends on short tests, not on one worker finishing a long one
    while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: False (heavy) first


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before any test when the temporary folder's disk lacks the room the suite needs."""
    tmp = Path(tempfile.gettempdir())
    free = shutil.disk_usage(tmp).free / 2**30
    if free < TMP_NEEDED_GIB:
        pytest.exit(f"error: {free:.1f} GiB free under {tmp}; the tests need about {TMP_NEEDED_GIB:g} GiB for their "
                    "temporary files: free some space, or set TMPDIR to a folder on a larger disk", returncode=1)


def tiny(*names: str | Path) -> list[str]:
    """The ``--config`` flags of a tiny test config: ``tiny_trainer.yaml``, then each of ``names`` (in
    ``tests/configs`` unless a path)."""
    return ["--config", str(CONFIGS / "tiny_trainer.yaml"),
            *(arg for name in names for arg in ("--config", str(CONFIGS / name))), ]


def shipped(*names: str) -> list[str]:
    """The ``--config`` flags of shipped configs (``configs/...``), in order."""
    return [arg for name in names for arg in ("--config", str(REPO / "configs" / name))]


def printed_metrics(stdout: str, stage: str = "test") -> dict[str, str]:
    """The ``<stage>/...`` rows of Lightning's end-of-run metrics table (plain or rich), as printed: the exact
    text, no rounding of ours."""
    return dict(re.findall(rf"^[\s│|]*({stage}/[\w\-]+)[\s│|]+([-\d.e+]+)[\s│|]*$", stdout, flags=re.MULTILINE))


def console_script() -> str:
    """The installed ``vision-attn`` entry point of the interpreter running the tests."""
    script = Path(sys.executable).parent / "vision-attn"
    found = str(script) if script.exists() else shutil.which("vision-attn")
    if not found:
        raise RuntimeError("the vision-attn console script is not installed; run `make setup`")
    return found


def run_script(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``vision-attn ARGS`` as a user runs it, output captured."""
    return subprocess.run([console_script(), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """``vision-attn ARGS`` in this process, output captured (a new process would spend seconds importing
    Lightning again): the exit code of its SystemExit, or 0."""
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            main(list(args))
        except SystemExit as exit_info:
            code = exit_info.code if isinstance(exit_info.code, int) else 1
    return subprocess.CompletedProcess(list(args), code, stdout.getvalue(), stderr.getvalue())


# Runs in a fresh interpreter: `vision-attn ARGS` for each list of arguments in sys.argv[1] (JSON), printing each
# one's exit code and stderr as the last line, in JSON.
RUN_EACH = """
import contextlib, io, json, sys
from vision_attn.cli import main
commands, sys.argv = json.loads(sys.argv[1]), sys.argv[:1]  # the arguments are main's, not the interpreter's
outcomes = []
for args in commands:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(args)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
    outcomes.append([code, stderr.getvalue()])
print(json.dumps(outcomes))
"""


def run_each_in_a_fresh_process(commands: list[list[str]], *, env: dict[str, str] | None = None,
                                prefix: list[str] = (), preexec_fn: Callable[[], None] | None = None
                                ) -> list[subprocess.CompletedProcess]:
    """``vision-attn ARGS`` for each of ``commands``, one after another in one new interpreter (with ``env``, started
    through ``prefix``, e.g. setpriv, and after ``preexec_fn``, e.g. a resource limit): what a process-wide setting
    such as HF_HOME, a dropped capability or a cap does to them, without paying the interpreter's start-up per
    command."""
    done = subprocess.run([*prefix, sys.executable, "-c", RUN_EACH, json.dumps(commands)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    return [subprocess.CompletedProcess(args, code, "", err) for args, (code, err) in zip(commands, outcomes,
                                                                                         strict=True)]


@pytest.fixture(scope="session")
def vit_checkpoint(tmp_path_factory) -> Path:
    """A tiny ViT trained for a few steps on Fashion-MNIST through the in-process CLI."""
    run_dir = tmp_path_factory.mktemp("vit_run")
    main(["fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(run_dir)])
    checkpoint = next(run_dir.rglob("best.ckpt"))
    assert (checkpoint.parent / "last.ckpt").exists()
    return checkpoint


@pytest.fixture(scope="session")
def pretrained_encoder(tmp_path_factory) -> Path:
    """configs/captioner/fashion_scene_items.yaml for 6 steps: an encoder pretraining checkpoint (width 24)."""
    run_dir = tmp_path_factory.mktemp("encoder_run")
    main(["fit", *shipped("trainer/cpu.yaml", "tasks/classifier.yaml", "captioner/fashion_scene_items.yaml"),
          "--trainer.max_time", "null",
          "--trainer.limit_train_batches", "6", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "2",
          "--data.init_args.loader.eval_batch_size", "50",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(run_dir),
          "--trainer.default_root_dir", str(run_dir), "--trainer.callbacks.init_args.dirpath", str(run_dir / "ckpt")])
    return run_dir / "ckpt" / "best.ckpt"


@pytest.fixture(scope="session")
def trained_captioner(tmp_path_factory) -> dict[str, Path]:
    """A tiny captioner fitted for a few steps on a tiny generated scenes set, through the in-process CLI."""
    work = tmp_path_factory.mktemp("captioner")
    scenes, run = work / "scenes", work / "run"
    main(["fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root", str(scenes),
          "--trainer.default_root_dir", str(run)])
    return {"scenes": scenes, "run": run, "ckpt": next(run.rglob("best.ckpt"))}
