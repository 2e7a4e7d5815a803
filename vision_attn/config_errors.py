"""What LightningCLI (jsonargparse) refuses in ``fit``, ``validate``, ``test``, ``predict`` and ``cache-features``,
as one line naming the option or the config file, with the closest valid option where there is one.

jsonargparse's ``ArgumentError`` names no option, so the parser raises (``exit_on_error=False``) and the options
given are checked here, in order, against the parsers' options and the classes' signatures: an unknown option, a
``class_path`` that cannot be imported or is of another kind, a refused value, a required argument not given. Where
none is found, jsonargparse's own message, in one line.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import sys
import types
import typing
from argparse import ArgumentError
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple

import jsonargparse
import yaml

from vision_attn.config_files import CONFIG_FLAGS, SECTION_FLAGS, check_config_files, is_a_file, read_config

ABBREVIATIONS = {"lr": "learning_rate"}  # what a user may spell out when guessing a name
NOT_OPTIONS = {"help", "config", "print_config", "subcommand"}  # flags that set no option
SUBCLASS_ROOTS = ("model", "data")  # the options LightningCLI fills with a class_path and its init_args
PLAIN_TYPES = (int, float, str, bool, Path)  # the types whose values are checked here
MAX_DETAIL = 400  # characters of jsonargparse's own words kept in a message


def given_argv(args: Any) -> list[str]:
    """The command-line arguments LightningCLI parses: ``args``, ``sys.argv[1:]`` for None, none for a mapping."""
    return list(sys.argv[1:] if args is None else args) if isinstance(args, list | tuple | None) else []


class OneLineErrors:
    """Mixed into LightningCLI (``trainer_cli.VisionAttnCLI``) through its public hooks: the config files checked
    first, an unknown command refused, and what jsonargparse refuses raised as one line, not printed with usage."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = given_argv(kwargs.get("args"))
        check_config_files(argv)
        runs = kwargs.get("run", True)
        if runs:
            refuse_unknown_command(argv, list(self.subcommands()))
        self.option_parsers: list[Any] = []
        self.command = next((arg for arg in argv if arg in self.subcommands()), "") if runs else "cache-features"
        try:
            super().__init__(*args, **kwargs)
        except ArgumentError as error:  # refused after parsing (the checkpoint's hyper-parameters, a link)
            raise ValueError(in_one_line(error, self.command)) from None

    def init_parser(self, **kwargs: Any) -> Any:
        """LightningCLI's parser, raising what it refuses; each one made (one per command too) is kept."""
        kwargs.setdefault("exit_on_error", False)
        parser = super().init_parser(**kwargs)
        self.option_parsers.append(parser)
        return parser

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """LightningCLI's parsing; what jsonargparse refuses becomes the one line ``refusal`` finds."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            raise ValueError(self.refusal(given_argv(args)) or in_one_line(error, self.command)) from None

    def refusal(self, argv: Sequence[str]) -> str | None:
        """The first problem with the options of ``argv``, in one line (None where none is found here)."""
        parsers = [(parser, parser_options(parser)) for parser in self.option_parsers]
        all_keys = sorted({key for _, keys in parsers for key in keys} - NOT_OPTIONS)
        bases = {"model": self.model_class, "data": self.datamodule_class}
        classes: dict[str, tuple[str, Any]] = {}  # root -> (class_path as given, the class or None)
        given_arguments: dict[str, set[str]] = {}  # root -> the init_args given
        for given in given_options(argv, tuple(self.subcommands())):
            root, _, rest = given.key.partition(".")
            where = f"{given.source}: " if given.source else ""
            if rest.startswith("init_args."):
                given_arguments.setdefault(root, set()).add(rest.split(".")[1])
            if root in SUBCLASS_ROOTS:
                if rest in ("", "class_path") and isinstance(given.value, str):
                    found, problem = class_named(given.value, bases[root])
                    if problem:
                        return f"{where}{given.shown.removesuffix('.class_path')}: class_path {given.value}: {problem}"
                    classes[root] = (given.value, found)
                    continue
                class_path, found = classes.get(root, ("", None))
                if found is None or not rest.startswith("init_args."):
                    continue  # a class not known here, or a dict of options (dict_kwargs): jsonargparse's word
                keys = [f"{root}.init_args.{option}" for option in class_options(found)]
                hint, owner = option_type(found, rest.removeprefix("init_args.")), f" of {class_path}"
            else:
                keys, owner = all_keys, ""
                hint = option_type(self.trainer_class, rest) if root == "trainer" else \
                    option_type(getattr(self.trainer_class, self.command, None), given.key)
            if not accepts_key(given.key, keys):
                suggestion = closest(given.key, keys)
                said = f"{where}no option {given.shown}{owner}" if given.source else \
                    f"{given.shown}: no such option{owner}"
                return f"{said}; " + (f"did you mean {'' if given.source else '--'}{suggestion}?" if suggestion
                                      else help_hint(self.command))
            if given.value is None or isinstance(given.value, dict | list):
                continue  # jsonargparse's word on a whole class, list or mapping
            if root in SUBCLASS_ROOTS:
                refused = plain(hint) and not accepts(hint, given.value, given.raw)
            else:  # a command-line value is read as YAML, else as the text itself
                values = (yaml_value(given.value), given.value) if given.raw else (given.value,)
                refused = not any(validates(parsers, given.key, value) for value in values)
            if refused:
                return f"{where}{given.shown}: " + (f"expected {describe(hint)}, got {given.value}" if plain(hint) else
                                                    f"{given.value} is not a value it takes; {help_hint(self.command)}")
        for root, (class_path, found) in classes.items():
            if missing := [name for name in required_arguments(found) if name not in given_arguments.get(root, ())]:
                return f"{root}: class_path {class_path}: the following arguments are required: {', '.join(missing)}"
        return None


def parser_options(parser: Any) -> list[str]:
    """The dotted options of a jsonargparse ``parser`` (none where its defaults cannot be had)."""
    try:
        return list(parser.get_defaults().keys())
    except Exception:  # noqa: BLE001 - on the way to an error message: without its options, no suggestion
        return []


def validates(parsers: list[tuple[Any, list[str]]], key: str, value: Any) -> bool:
    """Whether each of the (parser, its options) ``parsers`` that has the option ``key`` accepts ``value`` for it."""
    for parser, keys in parsers:
        if key in keys:
            namespace = jsonargparse.Namespace()
            namespace[key] = value
            try:
                parser.validate(namespace, skip_required=True)
            except (TypeError, ValueError, KeyError):
                return False
    return True


def in_one_line(error: BaseException, command: str) -> str:
    """An error's message in one line, at most ``MAX_DETAIL`` characters, then where ``command``'s options are."""
    text = " ".join(str(error).split())
    return f"{f'{text[:MAX_DETAIL]}...' if len(text) > MAX_DETAIL else text}; {help_hint(command)}"


def help_hint(command: str) -> str:
    """Where to find the valid options of ``command`` ("": the commands)."""
    return f"`vision-attn {command} --help` lists the options" if command else "`vision-attn --help` lists the commands"


def refuse_unknown_command(argv: Sequence[str], commands: Sequence[str]) -> None:
    """Refuse a first argument that is neither an option nor one of ``commands``, with the closest command."""
    if not argv or argv[0].startswith("-") or argv[0] in commands:
        return
    found = difflib.get_close_matches(argv[0], commands, n=1)
    raise ValueError(f"{argv[0]}: no such command; " + (f"did you mean {found[0]}?" if found else help_hint("")))


class Given(NamedTuple):
    """An option given: its dotted key (with ``init_args``), its value, the config file that set it (None: the
    command line), its name as written, and whether the value is a command-line string (else YAML's)."""

    key: str
    value: Any
    source: Path | None
    shown: str
    raw: bool = False


def full_key(key: str) -> str:
    """``key`` with ``init_args`` where a ``model``/``data`` option leaves it out (``model.lr``)."""
    root, _, rest = key.partition(".")
    if root in SUBCLASS_ROOTS and rest and rest.partition(".")[0] not in ("class_path", "init_args", "dict_kwargs"):
        return f"{root}.init_args.{rest}"
    return key


def given_options(argv: Sequence[str], commands: Sequence[str]) -> Iterator[Given]:
    """The options of ``argv`` in jsonargparse's order, a config file's and a mapping's value's one by one."""
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("-"):
            continue  # the command
        flag, equals, value = arg.partition("=")
        if not equals:
            takes_value = index < len(argv) and not argv[index].startswith("--") and argv[index] not in commands
            value = argv[index] if takes_value else None
            index += takes_value
        key = flag.lstrip("-").removesuffix("+")
        if flag in CONFIG_FLAGS or (flag in SECTION_FLAGS and value and is_a_file(value)):
            path = Path(str(value))
            yield from mapping_options(read_config(path), "" if flag in CONFIG_FLAGS else key, "", path, commands)
        elif key.rpartition(".")[2] not in NOT_OPTIONS:
            mapping = yaml_value(value) if value is not None else None
            if isinstance(mapping, dict):
                yield from mapping_options(mapping, key, flag, None, commands)
            else:
                yield Given(full_key(key), value, None, flag, raw=True)


def mapping_options(node: Any, prefix: str, shown: str, source: Path | None,
                    commands: Sequence[str]) -> Iterator[Given]:
    """The options a mapping ``node`` (a config file's, or one given as ``shown``) sets under ``prefix``, down to
    its values (a ``class_path`` first); a command's block holds options too; ``name+`` appends to ``name``."""
    if not isinstance(node, dict):
        if prefix:
            yield Given(full_key(prefix), node, source, shown or prefix)
        return
    for name in sorted(node, key=lambda name: name != "class_path"):
        plain_name = str(name).removesuffix("+")  # "callbacks+": jsonargparse's append to a list
        key = f"{prefix}.{plain_name}" if prefix else plain_name
        named = f"{shown}.{name}" if shown else key
        if not prefix and name in commands:
            yield from mapping_options(node[name], "", "", source, commands)
        elif isinstance(node[name], dict) and name != "dict_kwargs":
            yield from mapping_options(node[name], key, named, source, commands)
        elif name not in NOT_OPTIONS:
            yield Given(full_key(key), node[name], source, named)


def yaml_value(text: str) -> Any:
    """What jsonargparse reads a command-line value as: YAML (the text itself where it is not YAML)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def required_arguments(cls: Any) -> list[str]:
    """The arguments of ``cls``'s constructor that have no default (none when it cannot be read)."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [parameter.name for parameter in parameters if parameter.default is parameter.empty
            and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)]


def accepts_key(key: str, keys: Iterable[str]) -> bool:
    """Whether ``key`` is one of ``keys``, a group of them, or inside one (``trainer.logger.init_args.x``)."""
    return any(key == option or option.startswith(f"{key}.") or key.startswith(f"{option}.") for option in keys)


def class_named(class_path: str, base: type) -> tuple[Any, str | None]:
    """(the class ``class_path`` names, None) or (None, why it is no ``base``); a bare name is looked for among
    the subclasses of ``base`` imported."""
    module_name, _, name = class_path.rpartition(".")
    if not module_name:
        found = [cls for cls in subclasses(base) if cls.__name__ == name]
        return (found[0], None) if len(found) == 1 else (None, None)  # jsonargparse resolves or refuses it
    try:
        found = getattr(importlib.import_module(module_name), name)
    except Exception as error:  # noqa: BLE001 - whatever importing it raises is why it cannot be used
        return None, str(error)
    if not (isinstance(found, type) and issubclass(found, base)):
        return None, f"not a {base.__name__}"
    return found, None


def subclasses(base: type) -> Iterator[type]:
    """Every subclass of ``base`` imported so far, at any depth."""
    for cls in base.__subclasses__():
        yield cls
        yield from subclasses(cls)


@functools.cache
def class_options(cls: type) -> list[str]:
    """The dotted option names of ``cls``'s ``__init__`` (its init_args), as jsonargparse reads them."""
    try:
        parser = jsonargparse.ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        return [key for key in parser_options(parser) if key.rpartition(".")[2] not in NOT_OPTIONS]
    except Exception:  # noqa: BLE001 - without its options there is only no suggestion
        return []


def option_type(owner: Any, dotted: str) -> Any:
    """The annotated type of the option ``dotted`` of ``owner`` (None where it cannot be told): of a class, the
    ``__init__`` argument of the first class in its MRO that names it; of a function, its argument; then option
    group fields."""
    first, *rest = dotted.split(".")
    try:
        owners = [klass.__init__ for klass in owner.__mro__] if isinstance(owner, type) else [owner]
        hint = next((found for each in owners if (found := typing.get_type_hints(each).get(first)) is not None), None)
        for name in rest:
            group = next((member for member in members(hint) if dataclasses.is_dataclass(member)), None)
            hint = typing.get_type_hints(group).get(name) if group is not None else None
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: nothing to check here
        return None
    return hint


def members(hint: Any) -> tuple[Any, ...]:
    """The types a union ``hint`` allows, less None (the type itself when it is no union)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(member for member in typing.get_args(hint) if member is not type(None))
    return (hint,)


def plain(hint: Any) -> bool:
    """Whether ``hint`` allows only ``PLAIN_TYPES``, choices and None, whose check is certain."""
    return hint is not None and all(typing.get_origin(member) is Literal or member in PLAIN_TYPES
                                    for member in members(hint))


def accepts(hint: Any, value: Any, from_command_line: bool) -> bool:
    """Whether jsonargparse accepts ``value`` (from the command line, or a config's) for an option of type ``hint``."""
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--value", type=hint)
    try:
        if from_command_line:
            parser.parse_args(["--value", str(value)])
        else:
            parser.parse_object({"value": value})
    except (ArgumentError, TypeError, ValueError):
        return False
    return True


def describe(hint: Any) -> str:
    """A plain type in words: ``int``, ``one of 'soft', 'hard'``, ``int or str``."""
    return " or ".join("one of " + ", ".join(repr(choice) for choice in typing.get_args(member))
                       if typing.get_origin(member) is Literal else getattr(member, "__name__", str(member))
                       for member in members(hint))


def _spelled_out(name: str) -> str:
    return ".".join(ABBREVIATIONS.get(part, part) for part in name.split("."))


def _nearest(words: Sequence[str], named: Iterable[tuple[str, str]]) -> str | None:
    """The key of the first of ``words`` that difflib finds close to a name of the (name, key) pairs ``named``,
    each name also spelled out (``ABBREVIATIONS``)."""
    by_name: dict[str, str] = {}
    for name, key in named:
        by_name.setdefault(name, key)
        by_name.setdefault(_spelled_out(name), key)
    return next((by_name[found[0]] for word in words
                 if (found := difflib.get_close_matches(word, list(by_name), n=1, cutoff=0.8))), None)


def closest(bad: str, keys: Sequence[str]) -> str | None:
    """The option of ``keys`` closest to ``bad``: the only one of its section with its last name (``model.lr``),
    else by difflib the closest last name in its group, else the closest whole name of the others; ``ABBREVIATIONS``
    spelled out match too."""
    group, _, leaf = bad.rpartition(".")
    same_leaf = [key for key in keys if key.partition(".")[0] == bad.partition(".")[0]
                 and key.rpartition(".")[2] in (leaf, _spelled_out(leaf))]
    if len(same_leaf) == 1:
        return same_leaf[0]
    in_group = [key for key in keys if key.startswith(f"{group}.")] if group else list(keys)
    return _nearest((leaf, _spelled_out(leaf)), ((key.rpartition(".")[2], key) for key in in_group)) or \
        _nearest((bad, _spelled_out(bad)), ((key, key) for key in keys if key not in in_group))
