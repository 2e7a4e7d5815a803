"""The documentation holds: the site builds with warnings as errors, the references are current and complete, every
public module, class and function has a docstring, and the README is short and leads with what users come for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

README = REPO / "README.md"
QUICK_STARTS = ["COCO with GPUs", "your own photos", "with the ViT", "attention maps", "Lightning test run"]


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """mkdocs --strict: a broken link or anchor, a page missing from the nav, or an API object mkdocstrings
    cannot find fails the build."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, env=env)
    assert built.returncode == 0, built.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "evaluation" / "index.html").read_text(encoding="utf-8")
    assert "load_captioner" in api and "CaptionResult" in api  # the docstrings are rendered, not just the titles


def test_the_command_line_reference_is_current() -> None:
    # In a fresh interpreter, as a user's `--help` runs: the Lightning commands' help lists the subclasses of
    # LightningModule the process has imported, which in the suite's process are many more
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "cli_reference.py"), "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for tool in ("caption", "classify", "overlay", "explore", "evaluate", "make-scenes", "cache-features"):
        assert f"### `vision-attn {tool}`" in page


def test_the_api_reference_renders_every_module_once() -> None:
    modules = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
               for path in (REPO / "vision_attn").rglob("*.py")}
    listed = [line.removeprefix("::: ").strip() for page in (REPO / "docs" / "api").glob("*.md")
              for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("::: ")]
    assert sorted(listed) == sorted(set(listed)), "a module is listed twice"
    assert set(listed) == modules, (f"missing: {sorted(modules - set(listed))}, "
                                    f"not modules: {sorted(set(listed) - modules)}")


def test_every_public_module_class_and_function_has_a_docstring() -> None:
    """interrogate at 100%, with pyproject.toml's settings (private and magic names aside)."""
    result = subprocess.run([sys.executable, "-m", "interrogate", "-vv", "vision_attn"], cwd=REPO,
                            capture_output=True, text=True)
    missed = [line for line in result.stdout.splitlines() if "MISSED" in line]
    assert result.returncode == 0 and not missed, "\n".join(missed) or result.stdout[-2000:]


def test_the_readme_is_short_starts_with_the_two_commands_and_leads_with_the_quick_starts() -> None:
    text = README.read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size <= 20_000, f"README.md is {size} bytes"
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert text.index("```bash") < text.index("\n## ")  # before any section
    headings = [match for match in re.finditer(r"^### \d\. (.*)$", text, re.M)]
    assert [any(q in h.group(1) for h in headings) for q in QUICK_STARTS] == [True] * 5, [h.group(1) for h in headings]
    assert all(h.start() < len(text) / 2 for h in headings), "the quick starts belong in the README's first half"


def test_the_readme_links_only_files_that_exist() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert local and all((REPO / link).exists() for link in local), [link for link in local
                                                                      if not (REPO / link).exists()]


def test_every_test_the_robustness_page_names_exists() -> None:
    """The guarantees page cites the tests that hold each promise: every ``test_x.py`` and ``test_x.py::name``
    it names is a file of the suite holding that test (a ``test_*`` prefix: some test starting so)."""
    page = (REPO / "docs" / "robustness.md").read_text(encoding="utf-8")
    cited = re.findall(r"(test_\w+\.py)(?:::(test_\w+\*?))?", page)
    assert len(cited) >= 20
    for file, name in cited:
        source = (REPO / "tests" / file).read_text(encoding="utf-8")
        if name:
            end = "" if name.endswith("*") else r"\b"
            assert re.search(rf"def {name.rstrip('*')}" + end, source), (file, name)
