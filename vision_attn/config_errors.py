"""What LightningCLI (jsonargparse) refuses in ``fit``, ``validate``, ``test`` and ``cache-features``, as one line
naming the option or the config file, with the closest valid option where there is one.

jsonargparse reports a refusal with the whole usage block and, for a model's or DataModule's option, a dump of
the classes it tried; ``trainer_cli`` has it raise instead (``exit_on_error=False``) and raises
``config_error(...)``, which ``errors.exit_on_user_error`` prints as ``error: ...``. The config files are read
first (``check_config_files``): one that is not UTF-8 text, not YAML, empty, not a mapping or tagged with a
Python object is refused naming it, before anything is parsed.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from argparse import ArgumentError
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAGS = ("--config", "-c")
SECTION_FLAGS = ("--trainer", "--model", "--data")  # these take a config file of their section too
MAX_CONFIG_BYTES = 16 * 2**20  # a config is a few KB; more is not one
ABBREVIATIONS = {"lr": "learning_rate"}  # what a user may spell out when guessing a name
NOT_OPTIONS = {"help", "config", "print_config"}
MAX_DETAIL = 400  # characters of jsonargparse's own words kept in a message


class OneLineErrors:
    """Mixed into LightningCLI (``trainer_cli.VisionAttnCLI``): the config files checked first, and what
    jsonargparse refuses raised as one ``config_error`` line instead of printed with the usage block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.get("args")
        argv = list(sys.argv[1:] if argv is None else argv) if isinstance(argv, list | tuple | None) else []
        check_config_files(argv)
        try:
            super().__init__(*args, **kwargs)
        except ArgumentError as error:
            subcommand = next((arg for arg in argv if arg in self.subcommands()), None)
            parser = getattr(self, "_subcommand_parsers", {}).get(subcommand) or getattr(self, "parser", None)
            keys = [action.dest for action in getattr(parser, "_actions", ())]
            command = subcommand or ("" if hasattr(self, "_subcommand_parsers") else "cache-features")
            raise config_error(str(error), argv, keys, command) from None

    def init_parser(self, **kwargs: Any) -> Any:
        """LightningCLI's parser, raising what it refuses (``__init__`` words it) instead of printing the usage."""
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)


def config_files(args: Sequence[str]) -> list[tuple[str, Path]]:
    """The config files named in ``args``, in order, with the flag that named each: every ``--config``/``-c``
    value, and a ``--trainer``/``--model``/``--data`` value that is an existing file."""
    found = []
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        if flag in CONFIG_FLAGS or (flag in SECTION_FLAGS and value and Path(value).is_file()):
            found.append((flag, Path(value)))
    return found


def check_config_files(args: Sequence[str]) -> None:
    """Refuse, in one line naming it, a config file that does not exist or is not readable, not UTF-8 text,
    larger than ``MAX_CONFIG_BYTES``, not YAML, empty, not a mapping, or tagged with a Python object."""
    import yaml

    for flag, path in config_files(args):
        if not path.is_file():
            where = "no such file" if not path.exists() else "not a file"
            raise ValueError(f"{path}: {where}; {flag} takes a YAML config file")
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{path}: {path.stat().st_size / 2**20:.0f} MiB is not a config file (the limit is "
                             f"{MAX_CONFIG_BYTES // 2**20} MiB)")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not a YAML config file, byte {error.start} is not UTF-8 text (a binary "
                             "file?)") from None
        except OSError as error:
            raise ValueError(f"{path}: cannot be read ({error.strerror})") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.MarkedYAMLError as error:
            mark = error.problem_mark or error.context_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            tag = re.search(r"for the tag '([^']+)'", str(error.problem))
            if tag:
                raise ValueError(f"{path}: {where}the YAML tag {tag.group(1).replace('tag:yaml.org,2002:', '!!')} "
                                 "is refused: a config holds plain values (classes are named by class_path "
                                 "and init_args)") from None
            raise ValueError(f"{path}: not valid YAML, {where}{error.problem}") from None
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
        if loaded is None:
            raise ValueError(f"{path}: the config file is empty; it holds options such as trainer:, model: and "
                             "data:")
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file holds a mapping of options (trainer:, model:, data:), not a "
                             f"{type(loaded).__name__}")


def config_error(message: str, args: Sequence[str], keys: Iterable[str], command: str = "fit") -> ValueError:
    """jsonargparse's refusal ``message`` of ``args`` as a one-line ``ValueError``: the option, where it was set
    (the command line or the config file), what is wrong, and the closest of ``keys`` (the command's options)
    where one is close. ``command``: the subcommand parsed ("" when none was found)."""
    keys = [key for key in keys if key.rpartition(".")[2] not in NOT_OPTIONS]
    help_hint = (f"`vision-attn {command} --help` lists the options" if command
                 else "`vision-attn --help` lists the commands")
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        found = difflib.get_close_matches(choice.group(1), re.findall(r"'([^']+)'", choice.group(2)), n=1)
        return ValueError(f"{choice.group(1)}: no such command; "
                          + (f"did you mean {found[0]}?" if found else help_hint))
    key, class_path, unknown, detail = analyse(message)
    if len(detail) > MAX_DETAIL:
        detail = f"{detail[:MAX_DETAIL]}..."
    if key is None:
        return ValueError(f"{detail}; {help_hint}")
    where, shown = origin(key, args)
    if not unknown:
        return ValueError(f"{where}{shown}: {detail}")
    if class_path:
        root = key.partition(".init_args.")[0]
        keys = [f"{root}.init_args.{option}" for option in class_options(class_path)]
    suggestion = closest(key, keys)
    owner = f" of {class_path}" if class_path else ""
    found = f"no option {shown}{owner}" if where else f"{shown}: no such option{owner}"
    if suggestion:
        return ValueError(f"{where}{found}; did you mean {'' if where else '--'}{suggestion}?")
    return ValueError(f"{where}{found}; {help_hint}")


UNKNOWN = (r"Option '([^']+)' is not accepted", r"unrecognized arguments: -*([^\s=]+)",
           r"does not accept option '([^']+)'", r"Key '([^']+)' is not expected")
NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value",
         "Expected a <class 'NoneType'>", "Expected a path but")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def analyse(text: str, prefix: str = "") -> tuple[str | None, str | None, bool, str]:
    """What a jsonargparse error ``text`` is about: the dotted key (None when it names none), the class_path whose
    option it is (None: the command's own), whether the option is unknown, and what is wrong, in one line."""
    text = text.strip()
    root = re.match(r'Parser key "([^"]+)":\s*', text)
    key = f"{prefix}{root.group(1)}" if root else (prefix.removesuffix(".init_args.") or None)
    body = text[root.end():] if root else text
    lines = body.splitlines()
    for index, line in enumerate(lines):
        found = re.search(r"Problem with given class_path '([^']+)':\s*$", line)
        if found:
            inner = []
            for following in lines[index + 1:]:
                if following.strip() and _indent(following) <= _indent(line):
                    break
                inner.append(following)
            sub_key, sub_class, unknown, detail = analyse("\n".join(inner), f"{key}.init_args." if key else "")
            if sub_key is None or sub_key == key:
                return key, None, False, f"class_path {found.group(1)}: {detail}"
            return sub_key, sub_class or found.group(1), unknown, detail
    group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", body)
    if group:
        return f"{prefix}{group.group(1)}.{group.group(2)}", None, True, ""
    if not (root and "Parser key" in body):
        for pattern in UNKNOWN:
            found = re.search(pattern, body)
            if found:
                return f"{prefix}{found.group(1)}", None, True, ""
    reasons = [line.strip().removeprefix("- ").strip() for line in lines
               if line.strip() and not any(noise in line for noise in NOISE)]
    detail = "; ".join(reasons) or " ".join(body.split())
    detail = re.sub(r"<class '([^']+)'>", r"\1", detail).replace("Expected a ", "expected ")
    detail = re.sub(r"typing\.Literal\[(.*)\]", lambda found: f"one of {found.group(1)}", detail)
    given = re.search(r"Given value: (.*)", body)
    if given and "value" not in detail.lower() and len(given.group(1)) < 100:
        detail = f"{detail}, got {given.group(1).strip()}"
    return key, None, False, detail.replace(". Got value:", ", got")


def class_options(class_path: str) -> list[str]:
    """The dotted option names of the class ``class_path`` names (its init_args), as jsonargparse reads them."""
    import jsonargparse

    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        parser = jsonargparse.ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
    except Exception:  # noqa: BLE001 - without its options there is only no suggestion
        return []
    return [action.dest for action in parser._actions if not action.dest.endswith("help")]


def _spelled_out(key: str) -> str:
    return ".".join(ABBREVIATIONS.get(part, part) for part in key.split("."))


def closest(bad: str, keys: Sequence[str]) -> str | None:
    """The option of ``keys`` closest to ``bad`` (difflib): over whole dotted names first, then over their last
    part within the same group; abbreviations (``lr``) also match spelled out (``learning_rate``)."""
    candidates: dict[str, str] = {}
    for key in keys:
        candidates.setdefault(key, key)
        candidates.setdefault(_spelled_out(key), key)
    for wanted in (bad, _spelled_out(bad)):
        found = difflib.get_close_matches(wanted, list(candidates), n=1, cutoff=0.8)
        if found:
            return candidates[found[0]]
    group, _, leaf = bad.rpartition(".")
    in_group = [key for key in keys if key.startswith(f"{group}.")] if group else list(keys)
    leaves: dict[str, str] = {}
    for key in in_group:
        tail = key[len(group) + 1:] if group else key
        for name in (tail.rpartition(".")[2], _spelled_out(tail.rpartition(".")[2])):
            leaves.setdefault(name, key)
    found = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.8)
    return leaves[found[0]] if found else None


def origin(key: str, args: Sequence[str]) -> tuple[str, str]:
    """Where ``key`` was set: ``("", "--key")`` as the user wrote it on the command line, or
    ``("<file>: ", "key")`` for the last config file in ``args`` that sets it, else ``("", "--key")``."""
    short = key.replace(".init_args.", ".")
    for arg in args:
        flag = arg.partition("=")[0]
        if flag in (f"--{key}", f"--{short}"):
            return "", flag
    for _, path in reversed(config_files(args)):
        if _sets(path, key):
            return f"{path}: ", key
    return "", f"--{key}"


def _sets(path: Path, key: str) -> bool:
    """Whether the YAML config ``path`` sets ``key`` (``init_args`` may be left out, a subcommand may hold it)."""
    import yaml

    try:
        loaded: Any = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    parts = key.split(".")
    for start in (loaded, *(loaded.values() if isinstance(loaded, dict) else ())):
        if _holds(start, parts):
            return True
    return False


def _holds(node: Any, parts: list[str]) -> bool:
    if not parts:
        return True
    if not isinstance(node, dict):
        return False
    if parts[0] in node and _holds(node[parts[0]], parts[1:]):
        return True
    if parts[0] == "init_args":
        return _holds(node, parts[1:])
    dotted = ".".join(parts)
    return dotted in node
