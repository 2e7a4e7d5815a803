"""The option groups document themselves: every option of every task and DataModule has a one-line doc, which
`vision-attn fit --help` shows and docs/configuration.md lists, and that page is current."""

from __future__ import annotations

import importlib.util
import sys

from tests.conftest import REPO, run_in_process, tiny

SCRIPT = REPO / "scripts" / "configuration_reference.py"


def reference_module():
    spec = importlib.util.spec_from_file_location("configuration_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_option_of_every_task_and_datamodule_has_a_one_line_doc() -> None:
    module = reference_module()
    for cls in module.classes():
        rows = module.options(cls)
        assert rows, cls.__name__
        undocumented = [name for name, _, _, doc in rows if not doc]
        assert not undocumented, f"{cls.__name__}: {undocumented}"


def test_the_configuration_reference_is_current(monkeypatch) -> None:
    """The script's ``--check``, run in this process (as a script it would import torch and Lightning again)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # where it finds generated_page, as a script run does
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--check"])
    reference_module().main()  # exits 1 with one line if docs/configuration.md is not current


def test_help_shows_each_groups_options_with_their_docs() -> None:
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--model.help", "vision_attn.tasks.CaptionerTask")
    assert result.returncode == 0, result.stderr[-2000:]
    text = " ".join(result.stdout.split())
    assert "--model.decoder.attention_mode" in text and "soft (α's expectation, §4.2)" in text
    assert "--model.self_critical.from_progress" in text and "--model.optimiser.encoder_lr" in text


def test_the_docs_are_read_only_for_help_and_help_still_shows_them_after_a_run_without() -> None:
    """The options' docs cost a parse of every class's source, so only a help that shows them reads them; a help
    asked for after a run that did not read them (in the same process) still shows every group's docs."""
    from vision_attn.trainer_cli import asks_for_help

    assert asks_for_help(["fit", "--help"]) and asks_for_help(["-h"])
    assert asks_for_help(["fit", "--model.help", "vision_attn.tasks.CaptionerTask"])
    assert asks_for_help(["fit", "--data.help=vision_attn.datamodules.CocoCaptionsDataModule"])
    assert asks_for_help(["fit", "--print_config=comments"]) and not asks_for_help(["fit", "--print_config"])
    assert not asks_for_help(["fit", "--config", "help.yaml", "--trainer.default_root_dir", "runs/help"])
    printed = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--print_config")
    assert printed.returncode == 0, printed.stderr[-2000:]
    test_help_shows_each_groups_options_with_their_docs()
