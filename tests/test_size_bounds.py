"""Every size, count and beam option of every tool, and of the option groups, has an upper bound: one above it is
refused in one line that names the option and the bound, before any work; the largest allowed value finishes,
refuses cleanly, or keeps working within a memory cap, so an unbounded allocation fails a test, not the machine."""

from __future__ import annotations

import ast
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import REPO, run_in_process
from tests.test_output_folders import one_line_error
from vision_attn.captioning.options import DecoderOptions, DecodingOptions, EncoderOptions, SelfCriticalOptions
from vision_attn.data import scenes
from vision_attn.datamodules.data_options import (
    Augmentation,
    Canvas,
    FeatureCacheOptions,
    SceneGeneration,
    VocabularyOptions,
)
from vision_attn.option_groups import ImageFormat, Loader
from vision_attn.vit.classifier_options import ConvNetArchitecture, ViTArchitecture

# (the command before the option, the option, its bound): the command's other arguments need not exist, as the
# option is refused while parsing
BOUNDED = [
    (["caption", "--ckpt", "c.ckpt", "x.png"], "--beam", 50),
    (["caption", "--ckpt", "c.ckpt", "x.png"], "--batch-size", 1024),
    (["classify", "--ckpt", "c.ckpt", "x.png"], "--top-k", 1000),
    (["classify", "--ckpt", "c.ckpt", "x.png"], "--batch-size", 1024),
    (["overlay", "x.json", "--out", "o"], "--panel-size", 2048),
    (["overlay", "x.json", "--out", "o"], "--columns", 64),
    (["overlay", "x.json", "--out", "o"], "--sigma", 512),
    (["overlay", "x.png", "--ckpt", "c.ckpt", "--out", "o"], "--beam", 50),
    (["overlay", "x.png", "--ckpt", "c.ckpt", "--out", "o"], "--batch-size", 1024),
    (["explore", "--ckpt", "c.ckpt", "--images", "x.png", "--out", "o"], "--beam", 50),
    (["export-samples", "--out", "o"], "--count", 60000),
    (["export-samples", "--out", "o"], "--canvas-size", 1024),
    (["make-scenes", "--root", "o"], "--train", 100_000),
    (["make-scenes", "--root", "o"], "--val", 100_000),
    (["make-scenes", "--root", "o"], "--test", 100_000),
    (["make-scenes", "--root", "o"], "--canvas-size", 1024),
    (["make-scenes", "--root", "o"], "--grid-size", 8),
    (["rollout-mass", "--ckpt", "c.ckpt"], "--canvas-size", 1024),
    (["rollout-mass", "--ckpt", "c.ckpt"], "--count", 10000),
    (["erasure", "--ckpt", "c.ckpt", "--root", "s"], "--count", 100_000),
    (["erasure", "--ckpt", "c.ckpt", "--root", "s"], "--batch-size", 256),
    (["erasure", "--ckpt", "c.ckpt", "--root", "s"], "--beam", 50),
    (["deletion", "--ckpt", "c.ckpt"], "--canvas-size", 1024),
    (["deletion", "--ckpt", "c.ckpt"], "--count", 10000),
    (["deletion", "--ckpt", "c.ckpt"], "--steps", 256),
    (["deletion", "--ckpt", "c.ckpt"], "--batch-size", 1024),
    (["benchmark", "--out", "o.json"], "--threads", 1024),
]


@pytest.mark.parametrize(("command", "option", "bound"), BOUNDED, ids=lambda item: str(item))
def test_one_above_the_bound_is_one_line_before_any_work(command, option, bound, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_in_process(*command, option, str(bound + 1))
    one_line_error(result, option, f"at most {bound}", f"got {bound + 1} (")  # the bound, and why in brackets
    assert list(tmp_path.iterdir()) == []  # refused before any work: nothing written
    assert run_in_process(*command, option, "1e9").returncode == 2  # not a whole number: refused too


UNWRITABLE = {"o": "/dev/null/o", "o.json": "/dev/null/o.json"}  # under a file: any accepted value then fails there


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(BOUNDED), value=st.one_of(
    st.integers(-10**30, 10**30).map(str), st.floats().map(repr), st.text(max_size=8),
    st.sampled_from(["nan", "-inf", "1e309", "0x10", "1_000", " 3 ", "٣", "-0", "2.5", "", "1e2"])))
def test_fuzz_every_bounded_option_is_one_line_and_writes_nothing(case, value, tmp_path, monkeypatch) -> None:
    """Any text as a size, count or beam: refused in one line, or accepted and then stopped by the command's
    missing input or unwritable output, in one line; never a traceback, never anything written."""
    command, option, _ = case
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    result = run_in_process(*(UNWRITABLE.get(arg, arg) for arg in command), f"{option}={value}")
    one_line_error(result)
    assert sorted(tmp_path.rglob("*")) == before


SCANNED = [*sorted((REPO / "vision_attn" / "commands").glob("*.py")), REPO / "vision_attn" / "gallery.py",
           REPO / "vision_attn" / "cli_arguments.py", REPO / "benchmarks" / "run.py"]
NOT_SIZES = {"--seed", "--background-noise"}  # numbers that cost no memory, time or disk


def test_every_numeric_option_of_the_tools_is_bounded() -> None:
    """Every ``type=`` of the tools' options is bounded: no bare ``int`` or ``float``, no ``at_least`` or
    ``number_in`` without an upper bound, except for the numbers that cost nothing (``NOT_SIZES``)."""
    unbounded, bounded = [], 0
    for path in SCANNED:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):  # add_argument(..., type=...), OverlayOptions' _option(..., type=...)
                kind = next((k.value for k in node.keywords if k.arg == "type"), None)
                name = next((a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)),
                            "")
            elif isinstance(node, ast.Dict):  # SHARED_OPTIONS' settings: {"type": ..., ...}
                kind = next((v for k, v in zip(node.keys, node.values, strict=True)
                             if isinstance(k, ast.Constant) and k.value == "type"), None)
                name = ""
            else:
                continue
            if kind is None or name in NOT_SIZES:
                continue
            factory = kind.func.id if isinstance(kind, ast.Call) and isinstance(kind.func, ast.Name) else None
            if (isinstance(kind, ast.Name) and kind.id in ("int", "float")) or \
                    (factory in ("at_least", "number_in") and len(kind.args) < 2):
                unbounded.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
            bounded += factory == "bounded_int" or isinstance(kind, ast.Name) and kind.id.isupper()
    assert not unbounded, f"options without an upper bound: {unbounded}"
    assert bounded >= 10  # the scan does see the bounded ones


GROUP_BOUNDS = [  # (group, option, its bound, the other options it needs to be valid)
    (ImageFormat, "size", 4096, {}), (Loader, "batch_size", 8192, {}), (Loader, "eval_batch_size", 8192, {}),
    (Loader, "num_workers", 256, {}), (EncoderOptions, "width", 1024, {}), (EncoderOptions, "grid_size", 64, {}),
    (DecoderOptions, "embed_dim", 8192, {}), (DecoderOptions, "hidden_dim", 8192, {}),
    (DecoderOptions, "attention_dim", 8192, {}), (DecoderOptions, "attention_heads", 64, {}),
    (DecodingOptions, "beam_size", 50, {}), (DecodingOptions, "max_length", 200, {}),
    (SelfCriticalOptions, "samples", 64, {"from_epoch": 1}), (VocabularyOptions, "max_caption_length", 200, {}),
    (FeatureCacheOptions, "shard_size", 65536, {}), (Augmentation, "pad_crop", 256, {}),
    (Canvas, "size", 1024, {}), (ViTArchitecture, "patch_size", 256, {}), (ViTArchitecture, "depth", 256, {}),
    (ViTArchitecture, "embed_dim", 8192, {"num_heads": 1}), (ViTArchitecture, "num_heads", 256, {"embed_dim": 512}),
    (ViTArchitecture, "reg_tokens", 256, {}),
]


@pytest.mark.parametrize(("group", "option", "bound", "others"), GROUP_BOUNDS, ids=lambda item: str(item))
def test_the_groups_bound_their_sizes_counts_and_beams(group, option, bound, others) -> None:
    assert getattr(group.coerce({**others, option: bound}), option) == bound  # the bound itself is allowed
    with pytest.raises(ValueError, match=rf"^{group.name}\.{option} must be at most {bound} \(.+\), got {bound + 1}$"):
        group.coerce({**others, option: bound + 1})


def test_the_groups_bound_scene_counts_and_convnet_widths_and_the_generator_agrees_with_the_cli() -> None:
    with pytest.raises(ValueError, match=r"scenes\.counts\.train must be at most 100000 \(.+\), got 100001"):
        SceneGeneration.coerce({"counts": {"train": 100_001}})
    with pytest.raises(ValueError, match="at most 16 stages of at most 8192 channels"):
        ConvNetArchitecture.coerce({"widths": [8193]})
    assert (scenes.MAX_SCENES, scenes.MAX_CANVAS_SIZE, scenes.MAX_GRID_SIZE) == (100_000, 1024, 8)
    with pytest.raises(ValueError, match="at most 1024"):
        scenes.make_scenes("unused", counts={"test": 1}, canvas_size=1025, grid_size=3)
    assert not Path("unused").exists()


MEMORY_CAP = 4 << 30  # bytes of address space: torch, the model and a command's work fit; a runaway size does not
RUN_CAPPED = """import contextlib, io, json, signal, sys, time
import torch  # under the cap: the tools must still start
from vision_attn.cli import main

class TimeUp(BaseException):
    pass

def time_up(*_):
    raise TimeUp()

signal.signal(signal.SIGALRM, time_up)
outcomes = []
for seconds, args in json.loads(sys.argv[1]):
    err, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        signal.alarm(seconds)
        try:
            main(args)
            outcome = 0
        except SystemExit as exit_info:
            outcome = exit_info.code
        except TimeUp:
            outcome = "working"
        except BaseException as error:
            outcome = f"crashed: {type(error).__name__}: {error}"[:300]
        finally:
            signal.alarm(0)
    outcomes.append([outcome, err.getvalue()[-2000:], round(time.perf_counter() - start, 1)])
print(json.dumps(outcomes))
"""


def cap_memory() -> None:
    """In the child, before it runs: at most ``MEMORY_CAP`` bytes of address space."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


@pytest.mark.heavy
def test_the_largest_values_finish_or_refuse_cleanly_under_a_memory_cap(tmp_path, trained_captioner,
                                                                          vit_checkpoint) -> None:
    """Each tool at its options' largest values, in one process capped at 4 GiB: it finishes, refuses in one line,
    or (a count's work grows with the count, not its memory) is still working within the cap after a few
    seconds. A size that allocated without a bound would crash or be killed instead."""
    captioner, vit = str(trained_captioner["ckpt"]), str(vit_checkpoint)
    image = str(trained_captioner["scenes"] / "images" / "test" / "1.png")
    results = tmp_path / "results.json"
    assert run_in_process("caption", "--ckpt", captioner, image, "--out", str(results)).returncode == 0
    quick, counting = 120, 3  # seconds: a run that must end, and one whose count makes it long
    runs = [
        (quick, ["caption", "--ckpt", captioner, image, image, "--beam", "50", "--all-beams", "--batch-size", "1024",
                 "--out", str(tmp_path / "beams.json")]),
        (quick, ["classify", "--ckpt", vit, image, "--top-k", "1000", "--batch-size", "1024",
                 "--out", str(tmp_path / "classes.json")]),
        (quick, ["overlay", str(results), "--panel-size", "2048", "--columns", "64",
                 "--out", str(tmp_path / "overlays")]),
        (quick, ["overlay", str(results), "--panel-size", "64", "--sigma", "512", "--out", str(tmp_path / "blurred")]),
        (quick, ["overlay", "--ckpt", vit, image, "--columns", "64", "--batch-size", "1024",
                 "--out", str(tmp_path / "vit_overlays")]),
        (quick, ["explore", "--ckpt", captioner, "--images", image, "--beam", "50", "--out", str(tmp_path / "site")]),
        (quick, ["export-samples", "--canvas-size", "1024", "--count", "2", "--out", str(tmp_path / "big")]),
        (quick, ["export-samples", "--count", "60000", "--out", str(tmp_path / "refused")]),  # the test split: 10000
        (quick, ["make-scenes", "--canvas-size", "1024", "--grid-size", "8", "--train", "1", "--val", "0", "--test",
                 "0", "--root", str(tmp_path / "big_scenes")]),
        (counting, ["make-scenes", "--canvas-size", "1024", "--grid-size", "8", "--train", "100000", "--val",
                    "100000", "--test", "100000", "--root", str(tmp_path / "many_scenes")]),
        (counting, ["export-samples", "--split", "train", "--count", "60000", "--canvas-size", "1024",
                    "--out", str(tmp_path / "many")]),
        (counting, ["rollout-mass", "--ckpt", vit, "--canvas-size", "1024", "--count", "10000"]),
    ]
    done = subprocess.run([sys.executable, "-c", RUN_CAPPED, json.dumps(runs)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, preexec_fn=cap_memory)
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    for (_, args), (outcome, err, seconds) in zip(runs, outcomes, strict=True):
        assert outcome in (0, 2, "working"), (args[0], outcome, err, f"after {seconds} s")
        if outcome == 2:
            one_line_error(subprocess.CompletedProcess(args, 2, "", err))
    assert [outcome for outcome, *_ in outcomes[:7]] == [0] * 7, outcomes  # the small runs finish
    assert outcomes[7][0] == 2 and "more than the 10000 images" in outcomes[7][1]
    with_staging = [p for p in tmp_path.rglob(".vision-attn-staging-*")]
    assert not with_staging and not (tmp_path / "many_scenes").exists()  # a run cut short leaves nothing
    assert len(json.loads((tmp_path / "beams.json").read_text())[0]["beams"]) > 1
    assert all((tmp_path / name / "index.html").is_file() for name in ("overlays", "blurred", "vit_overlays", "site"))
    assert len(json.loads((tmp_path / "classes.json").read_text())[0]["top_k"]) == 10  # all of Fashion-MNIST's
    with Image.open(next((tmp_path / "big").glob("*.png"))) as png:
        assert png.size == (1024, 1024)
