"""Every shell and Python example of the README and the guides runs, as written, in a seeded sandbox
(tests/docs_runner.py); the ones marked as needing COCO, a GPU or root name a twin test that exists."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import timm
import torch
import yaml
from PIL import Image

from tests.docs_runner import PAGES, REPO, SHIM, TINY_FOR, CommandServer, examples, tiny_argv
from tests.test_classification_data import _write_cifar, _write_image_folder
from tests.test_pretrained_weights import fill_hub_cache
from vision_attn.cli import main
from vision_attn.data.scenes import make_scenes

RUN_PAGES = [page for page in PAGES if any(not e.twin for e in examples(page))]
# Where fashion_scenes.yaml looks for its scenes, and how it draws the training ones: the seed draws them so.
SCENES_DATA = yaml.safe_load((REPO / "configs" / "captioner" / "fashion_scenes.yaml").read_text())["data"]["init_args"]


@pytest.fixture(scope="session")
def seed(tmp_path_factory, vit_checkpoint) -> Path:
    """What a reader of the docs has at hand, once per worker: small Fashion scenes where the docs' configs look
    for them, the scenes captioner trained as `make demo` trains it (with the docs' tiny overrides) and its test
    results, a ViT, photos, an image folder, CIFAR-10 (a small release of its format) and the timm weights the
    docs name, in a Hugging Face cache."""
    root = tmp_path_factory.mktemp("docs_seed")
    counts = {"train": 12, "val": 4, "test": 4}
    make_scenes(root / SCENES_DATA["root"], counts=counts, seed=0, styles=SCENES_DATA["scenes"]["styles"])
    make_scenes(root / "data" / "fashion_scenes", counts=counts, seed=0)
    (root / "configs").symlink_to(REPO / "configs")
    cpu = ["--config", "configs/trainer/cpu.yaml"]
    previous = Path.cwd()
    os.chdir(root)
    try:
        for task, experiment in (("classifier", "fashion_scene_items"), ("captioner", "fashion_scenes")):
            main(tiny_argv(["fit", *cpu, "--config", f"configs/tasks/{task}.yaml", "--config",
                            f"configs/captioner/{experiment}.yaml"]))
        main(tiny_argv(["test", *cpu, "--config", "configs/tasks/captioner.yaml", "--config",
                        "configs/captioner/fashion_scenes.yaml", "--ckpt_path",
                        "runs/captioner_fashion_scenes/checkpoints/last.ckpt"]))
    finally:
        os.chdir(previous)
    (root / "configs").unlink()
    for name in ("vit_fashion_mnist", "vit_fashion_mnist_canvas"):
        (root / "runs" / name / "checkpoints").mkdir(parents=True)
        shutil.copy(vit_checkpoint, root / "runs" / name / "checkpoints" / "last.ckpt")
    photos = root / "photos"
    photos.mkdir()
    scenes = sorted((root / "data" / "fashion_scenes" / "images" / "test").glob("*.png"))
    Image.open(scenes[0]).convert("RGB").resize((160, 120)).save(photos / "street.jpg", quality=90)
    Image.open(scenes[1]).convert("L").save(photos / "grey.png")
    _write_cifar(root / "data" / "cifar10", binary=False)
    for split in ("train", "val"):
        _write_image_folder(root / "data" / "my_images", split)
    torch.manual_seed(0)
    fill_hub_cache(root / "hf" / "hub", "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k",
                   timm.create_model("vit_tiny_patch16_224").state_dict())
    return root


@pytest.fixture(scope="session")
def server(seed: Path, tmp_path_factory):
    """The command server the examples' `vision-attn` calls run in, with a reader's environment: offline, the
    Hugging Face cache holding the timm weights the docs name, one thread."""
    home = tmp_path_factory.mktemp("docs_home")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "HF_HOME": str(seed / "hf"),
           "HF_HUB_CACHE": str(seed / "hf" / "hub"), "HF_HUB_OFFLINE": "1", "TORCH_HOME": str(home / "torch"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg", "LANG": "C.UTF-8"}
    running = CommandServer(env, home)
    yield running
    running.close()


def fitted_runs(code: str) -> set[str]:
    """The run folders that the `vision-attn fit` lines of ``code`` write (shell variables expanded)."""
    text = code.replace("\\\n", " ")
    variables = dict(re.findall(r'^(\w+)="([^"]*)"', text, re.M))
    expand = lambda line: re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), ""), line)  # noqa: E731
    for _ in range(3):  # variables made of variables
        variables = {name: expand(value) for name, value in variables.items()}
    runs = set()
    for line in map(expand, text.splitlines()):
        if line.strip().startswith("vision-attn fit") and "--print_config" not in line:
            named = re.findall(r"--trainer.default_root_dir (\S+)", line)
            configs = [config for config in TINY_FOR if config in line]
            runs |= set(named) or {yaml.safe_load((REPO / c).read_text())["trainer"]["default_root_dir"]
                                   for c in configs}
    return runs


def sandbox(seed: Path, tmp_path: Path, code: str = "") -> Path:
    """A fresh copy of the seed, with the repo's configs, to run one page's examples in; a run the page trains
    itself is not seeded, as on a fresh checkout."""
    work = tmp_path / "work"
    shutil.copytree(seed, work, ignore=shutil.ignore_patterns("hf"))
    (work / "configs").symlink_to(REPO / "configs")
    for folder in fitted_runs(code):
        shutil.rmtree(work / folder, ignore_errors=True)
    return work


@pytest.mark.heavy
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_the_examples_of_a_page_run_as_written(page: Path, seed: Path, server: CommandServer, tmp_path: Path) -> None:
    runnable = [example for example in examples(page) if not example.twin]
    work = sandbox(seed, tmp_path, "".join(example.code for example in runnable))
    log = tmp_path / "log.txt"
    for example in runnable:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"\n### {example.where}\n")
        run = server.run_bash if example.language == "bash" else server.run_python
        status = run(example.code, work, log)
        assert status == 0, f"{example.where} failed (exit {status}):\n{log.read_text()[-6000:]}"


def test_examples_that_cannot_run_here_name_a_twin_test_that_exists() -> None:
    twins = [example for page in PAGES for example in examples(page) if example.twin]
    assert twins, "the COCO guide's examples are marked with their twin"
    for example in twins:
        path, name, why = example.twin
        assert why.strip(), f"{example.where}: say why it does not run here"
        tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert name in names, f"{example.where}: its twin {path}::{name} does not exist"


def test_every_page_has_examples_and_every_block_is_bash_or_python() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert examples(page), f"{page.relative_to(REPO)} has no example"
        fences = [line.strip() for line in text.splitlines() if line.startswith("```") and line.strip() != "```"]
        assert set(fences) <= {"```bash", "```python", "```text", "```json", "```yaml"}, (page, set(fences))


def test_the_runner_appends_tiny_overrides_and_refuses_an_unknown_fit() -> None:
    fit = ["fit", "--config", "configs/trainer/cpu.yaml", "--config", "configs/vit/fashion_mnist.yaml"]
    rewritten = tiny_argv(fit)
    assert rewritten[:len(fit)] == fit and rewritten[-1].endswith("tests/configs/docs/vit.yaml")
    gpu = ["fit", "--config", "configs/trainer/gpu.yaml", "--config", "configs/vit/cifar10.yaml"]
    assert tiny_argv(gpu)[:5] == ["fit", "--config", "configs/trainer/cpu.yaml", "--config", "configs/vit/cifar10.yaml"]
    assert tiny_argv(["make-scenes", "--root", "x", "--train", "20000", "--val", "0"])[-3:] == ["12", "--val", "0"]
    with pytest.raises(ValueError, match="TINY_FOR"):
        tiny_argv(["fit", "--config", "configs/captioner/coco_vgg19.yaml"])


@pytest.mark.heavy
def test_make_demo_and_demo_vit_run_end_to_end_on_tiny_overrides(seed: Path, server: CommandServer,
                                                                   tmp_path: Path) -> None:
    """The Makefile's demos, every step, in a sandbox: `.venv/bin/vision-attn` there runs each command with the
    docs' tiny overrides (setup, which needs root and the network, is taken as done)."""
    work = sandbox(seed, tmp_path)
    (work / "Makefile").symlink_to(REPO / "Makefile")
    shim = work / ".venv" / "bin" / "vision-attn"
    shim.parent.mkdir(parents=True)
    shim.write_text(SHIM)
    shim.chmod(0o755)
    shutil.rmtree(work / "runs")
    log = tmp_path / "log.txt"
    status = server.run_bash("make -o setup -o chromium demo demo-vit", work, log)
    assert status == 0, log.read_text()[-6000:]
    text = log.read_text()
    run = work / "runs" / "captioner_fashion_scenes"
    assert (run / "results_test.json").is_file() and (run / "scores_held_out_test.json").is_file()
    assert len(list((run / "overlays").glob("*.png"))) == 6 and (run / "explorer" / "index.html").is_file()
    assert len(list((work / "runs" / "vit_fashion_mnist" / "overlays").glob("*.png"))) == 8
    assert text.count("$ vision-attn fit") == 3 and "wrote the attention explorer" in text


def test_pip_install_of_the_checkout_gives_the_command(tmp_path: Path) -> None:
    """`pip install .` into a fresh environment that already has torch and the other dependencies (here: this
    suite's, seen through a .pth file): the package and its console script, not an editable link."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "vision_attn", source / "vision_attn", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                                "--no-build-isolation", str(source)], capture_output=True, text=True, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    helped = subprocess.run([str(venv / "bin" / "vision-attn"), "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0 and "caption" in helped.stdout, helped.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import vision_attn; print(vision_attn.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site)), where
    assert (site / "vision_attn" / "explorer_assets" / "index.html").is_file()  # package data installed too


def test_the_sandbox_leaves_out_the_runs_a_page_trains_itself() -> None:
    code = ('CPU="--config configs/trainer/cpu.yaml"\nVIT="$CPU --config configs/vit/fashion_mnist.yaml"\n'
            'vision-attn fit $VIT\nvision-attn fit $CPU --config configs/captioner/fashion_scenes.yaml --print_config\n'
            'vision-attn fit $VIT \\\n    --trainer.default_root_dir runs/other\n')
    assert fitted_runs(code) == {"runs/vit_fashion_mnist", "runs/other"}
