"""The package's shape: imports run one way (no cycle, no layer importing a layer above it; benchmarks/ and
scripts/ import the package, never the other way), the inference tools and ``--help`` start without Lightning,
and docs/architecture.md names every module that exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "vision_attn"
OUTSIDE = (REPO / "benchmarks", REPO / "scripts")  # programs run from a checkout: above the package, outside it

# Lower layers never import higher ones: models and data, then metrics/overlay/evaluation, then the Lightning
# tasks, then the command line. A module may import its own layer and the ones below.
LAYERS = [
    {"vision_attn", "vision_attn.errors", "vision_attn.io", "vision_attn.cli_arguments", "vision_attn.option_groups",
     "vision_attn.hardware"},
    {"vision_attn.checkpoint", "vision_attn.checkpoint_checks", "vision_attn.data.*", "vision_attn.datamodules.*",
     "vision_attn.captioning", "vision_attn.captioning.options", "vision_attn.captioning.encoder",
     "vision_attn.captioning.vit_trunk", "vision_attn.captioning.seams", "vision_attn.captioning.extensions.*",
     "vision_attn.captioning.fast_additive", "vision_attn.captioning.fast_lstm",
     "vision_attn.captioning.product_attention", "vision_attn.captioning.decoder", "vision_attn.captioning.compiled",
     "vision_attn.captioning.beam_search",
     "vision_attn.captioning.upgrades",
     "vision_attn.captioning.likelihood", "vision_attn.captioning.reinforce",
     "vision_attn.captioning.captioner", "vision_attn.vit",
     "vision_attn.vit.classifier_options",
     "vision_attn.vit.vision_transformer", "vision_attn.vit.rollout", "vision_attn.vit.pretrained",
     "vision_attn.vit.convnet", "vision_attn.vit.classifier", "vision_attn.weights", "vision_attn.boxes"},
    {"vision_attn.metrics", "vision_attn.overlay", "vision_attn.results", "vision_attn.captioning.evaluation",
     "vision_attn.captioning.erasure", "vision_attn.captioning.self_critical", "vision_attn.vit.map_figures",
     "vision_attn.vit.rollout_mass", "vision_attn.vit.distillation",
     "vision_attn.gallery", "vision_attn.explorer", "vision_attn.api"},
    {"vision_attn.tasks.*"},
    {"vision_attn.trainer_cli", "vision_attn.trainer_callbacks", "vision_attn.ckpt_path", "vision_attn.config_errors",
     "vision_attn.config_files", "vision_attn.cli", "vision_attn.commands.*"},
]
LIGHTNING_ALLOWED = {"vision_attn.datamodules.*", "vision_attn.tasks.*", "vision_attn.trainer_cli",
                     "vision_attn.trainer_callbacks", "vision_attn.ckpt_path"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def matches(name: str, patterns: set[str]) -> bool:
    return any(name == p or (p.endswith(".*") and name.startswith(p[:-1])) or name == p.removesuffix(".*")
               for p in patterns)


def layer(name: str) -> int:
    found = [index for index, patterns in enumerate(LAYERS) if matches(name, patterns)]
    assert found, f"{name} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return found[0]


def imports(*folders: Path) -> dict[str, set[str]]:
    """Every module under ``folders`` (default: the package) -> the modules and third-party top-level packages it
    imports anywhere in its file (function-level imports count: a lazy import still runs one way or the other).
    A script's import of a script beside it (``from generated_page import ...``, found on the script's own path)
    names it as ``scripts.generated_page``."""
    graph: dict[str, set[str]] = {}
    for path in sorted(path for folder in folders or (PACKAGE,) for path in folder.rglob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        beside = {sibling.stem for sibling in path.parent.glob("*.py")} if path.parent in OUTSIDE else set()
        graph[module_name(path)] = {f"{module_name(path.parent)}.{target}" if target.split(".")[0] in beside
                                    else target for target in found}
    return graph


def internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {name: {target for target in targets if target in graph and target != name}
            for name, targets in graph.items()}


def test_every_module_has_a_layer_and_imports_only_its_own_or_lower_layers() -> None:
    wrong = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
             for name, targets in internal(imports()).items() for target in targets if layer(target) > layer(name)]
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_cycle() -> None:
    """Among the package's modules, the benchmarks and the scripts."""
    graph = internal(imports(PACKAGE, *OUTSIDE))
    graph = {name: {t for t in targets if not name.startswith(f"{t}.")} for name, targets in graph.items()}  # parents
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join([*path, name, target])}"
            if target not in state:
                visit(target, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_benchmarks_and_scripts_import_the_package_never_the_other_way() -> None:
    def reaches(targets: set[str], folder: str) -> list[str]:
        return sorted(target for target in targets if target.split(".")[0] == folder)

    wrong = [f"{name} imports {reaches(targets, folder)}" for name, targets in imports().items()
             for folder in ("benchmarks", "scripts") if reaches(targets, folder)]
    wrong += [f"{name} imports {reaches(targets, 'scripts')}" for name, targets in imports(OUTSIDE[0]).items()
              if reaches(targets, "scripts")]  # a benchmark is no script's client either
    assert not wrong, "\n".join(wrong)
    users = {name for name, targets in imports(*OUTSIDE).items() if reaches(targets, "vision_attn")}
    assert any(name.startswith("benchmarks.") for name in users) and any(name.startswith("scripts.") for name in users)


def test_lightning_is_imported_only_by_the_tasks_datamodules_and_trainer_cli() -> None:
    users = {name for name, targets in imports().items()
             if any(re.match(r"(lightning|pytorch_lightning|torchmetrics)(\.|$)", target) for target in targets)}
    assert users and all(matches(name, LIGHTNING_ALLOWED) for name in users), sorted(users)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_inference_tools_start_without_lightning_and_the_captioner_without_torchvision() -> None:
    result = run_python(
        "import sys\n"
        "import vision_attn.captioning.evaluation, vision_attn.cli\n"
        "print(sorted(m for m in ('torchvision', 'timm', 'lightning') if m in sys.modules))\n"
        "import vision_attn.gallery, vision_attn.vit.map_figures, vision_attn.vit.rollout_mass\n"
        "import vision_attn.data.scenes\n"
        "print('lightning' in sys.modules)\n"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["[]", "False"]


def test_help_imports_no_torch() -> None:
    result = run_python("import sys\nfrom vision_attn.cli import main\nmain(['--help'])\nprint('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "caption" in result.stdout and result.stdout.strip().endswith("False")


def test_the_architecture_doc_names_every_module_and_no_other() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(vision_attn/[\w/]+\.py)`", text))
    files = {str(path.relative_to(REPO)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py"}
    assert not files - named, f"not in docs/architecture.md: {sorted(files - named)}"
    assert not named - files, f"docs/architecture.md names files that do not exist: {sorted(named - files)}"
