"""Write the configuration reference, docs/configuration.md, from the option groups' own docs.

    python scripts/configuration_reference.py [--check]

Every task and DataModule, every option it takes (a group's fields as ``group.field``), its type, default and the
one-line doc that ``vision-attn fit --help`` shows: read through jsonargparse, as the command line reads them.
``--check`` writes nothing and exits 1 when the file is not what it would write (the test suite runs it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jsonargparse

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "configuration.md"
LINKED = {"vocabulary", "image", "objects", "num_classes", "class_names", "colour_names"}  # trainer_cli links them
REQUIRED = "*required*"  # the default column of an option without a default: the config must give it


def classes() -> list[type]:
    from vision_attn import datamodules, tasks

    return [tasks.CaptionerTask, tasks.EncoderPretrainingTask, tasks.ViTTask, tasks.ConvNetTask,
            datamodules.CocoCaptionsDataModule, datamodules.FashionMNISTDataModule,
            datamodules.FashionMNISTCanvasDataModule, datamodules.FashionSceneItemsDataModule,
            datamodules.CIFAR10DataModule, datamodules.ImageFolderDataModule]


def options(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, doc) of each option of ``cls``, a group's fields as ``group.field``, in order."""
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init_args", fail_untyped=False)
    rows = []
    for action in parser._actions:
        name = action.dest.removeprefix("init_args.")
        if not action.dest.startswith("init_args.") or action.help == "Path to a configuration file." \
                or name.endswith(".help"):
            continue
        if name in LINKED:
            rows.append((name, "linked", "from the DataModule", _doc(action.help) or "set by the CLI's link"))
            continue
        kind = getattr(action, "_typehint", None) or action.type
        kind = kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "").replace("NoneType", "None")
        rows.append((name, kind, REQUIRED if action.required else _default(action.default), _doc(action.help)))
    return rows


def _doc(text: object) -> str:
    return " ".join(str(text).split()) if isinstance(text, str) and "%(" not in text else ""


def _default(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("\n", " ")


def reference() -> str:
    lines = ["# Configuration reference", "",
             "Every option of every task and DataModule, as a config gives it under `model.init_args` or "
             "`data.init_args` (a group's field as `group.field`: `--model.init_args.decoder.embed_dim 256` on the "
             "command line). Written by `python scripts/configuration_reference.py` from the option groups' own "
             "docs, which `vision-attn fit --help` shows too; `tests/test_configuration_reference.py` keeps it "
             "current. Options marked *linked* are set by the CLI from the DataModule.", ""]
    for cls in classes():
        summary = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        lines += [f"## {cls.__name__}", "", f"`{cls.__module__.rsplit('.', 1)[0]}.{cls.__name__}`: {summary}", "",
                  "| option | type | default | what it does |", "| --- | --- | --- | --- |"]
        for name, kind, default, doc in options(cls):
            shown = default if default == REQUIRED else f"`{default.replace('|', '&#124;')}`"
            lines.append(f"| `{name}` | {kind.replace('|', '&#124;')} | {shown} | {doc.replace('|', '&#124;')} |")
        lines.append("")
    return "\n".join(lines + extensions())


def extensions() -> list[str]:
    """The captioner's extensions, by the list that names them, each with its options (its ``Options`` group)."""
    import dataclasses

    from vision_attn.captioning import extensions as registered

    lines = ["## The captioner's extensions", "",
             "What a list of the captioner's groups may name (docs/architecture.md, the seams): an entry is the "
             "extension's name, or a mapping of its `name` and the options below.", ""]
    for option, registry in (("decoder.attention_inputs", registered.ATTENTION_INPUTS),
                             ("decoder.output_terms", registered.OUTPUT_TERMS),
                             ("decoding.processors", registered.PROCESSORS),
                             ("objective.auxiliary", registered.AUXILIARY),
                             ("self_critical.rewards", registered.REWARDS)):
        lines += [f"### `{option}`", "", "| extension | what it is | option | type | default | what it does |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, cls in registry.items():
            summary = " ".join((cls.__doc__ or "").strip().split())
            fields = dataclasses.fields(cls.Options) or [None]
            docs = _attribute_docs(cls.Options)
            for index, field in enumerate(fields):
                summary = summary if index == 0 else ""
                if field is None:
                    lines.append(f"| `{name}` | {summary} | | | | |")
                    continue
                default = field.default_factory() if field.default_factory is not dataclasses.MISSING \
                    else field.default
                kind = field.type if isinstance(field.type, str) else field.type.__name__
                lines.append(f"| `{name}` | {summary} | `{field.name}` | {kind.replace('|', '&#124;')} | "
                             f"`{_default(default)}` | {docs.get(field.name, '')} |")
        lines.append("")
    return lines


def _attribute_docs(group: type) -> dict[str, str]:
    """Each field's doc, the string under it in the class body (and its bases')."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for cls in reversed(group.__mro__[:-1]):
        try:
            body = ast.parse(inspect.getsource(cls).lstrip()).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = _doc(after.value.value)
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not current; write nothing")
    from generated_page import write_or_check  # beside this script; imported here, as the tests load the rest

    write_or_check(TARGET, reference(), check=parser.parse_args().check)


if __name__ == "__main__":
    main()
