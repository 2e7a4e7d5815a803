"""The config files of ``fit``, ``validate``, ``test``, ``predict`` and ``cache-features``, found on the command line
and inside configs, checked before LightningCLI reads them: each problem is one line naming the file. A value given
on the command line is YAML to jsonargparse too: its aliases and nesting are bounded the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

CONFIG_FLAGS = ("--config", "-c")
SECTION_FLAGS = ("--trainer", "--model", "--data")  # these take a config file of their section too
MAX_CONFIG_BYTES = 16 * 2**20  # a config is a few KB; more is not one
MAX_CONFIG_DEPTH = 64  # a config nests a few levels (model, init_args, a group, a list of its entries)
YAML_SUFFIXES = (".yaml", ".yml")
YAML_TAG_PREFIX = "tag:yaml.org,2002:"  # how PyYAML names the ``!!`` tags


def config_files(args: Sequence[str]) -> list[tuple[str, Path]]:
    """(flag, file) for each config file of ``args``, in order: the ``CONFIG_FLAGS``' values, and the values of
    ``SECTION_FLAGS`` or any option that are existing files (``.yaml``/``.yml`` for the others)."""
    found = []
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=")
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        is_file = bool(value) and is_a_file(value)
        if flag in CONFIG_FLAGS or (flag.startswith("-") and is_file and (
                flag in SECTION_FLAGS or value.lower().endswith(YAML_SUFFIXES))):
            found.append((flag, Path(value)))
    return found


def is_a_file(value: str) -> bool:
    """Whether a command-line value names an existing file (a value too long, or with a NUL, names none)."""
    try:
        return Path(value).is_file()
    except (OSError, ValueError):
        return False


def check_config_files(args: Sequence[str]) -> None:
    """Refuse, in one line naming it, a config file of ``args`` or a YAML file one names (``check_config_file``),
    and a command-line value past the bounds (``check_yaml_values``)."""
    seen: set[Path] = set()
    files = config_files(args)
    while files:
        flag, path = files.pop(0)
        if path.resolve() not in seen:
            seen.add(path.resolve())
            files += [(flag, named) for named in named_yaml_files(check_config_file(flag, path), path)]
    check_yaml_values(args)


def check_config_file(flag: str, path: Path) -> dict[str, Any]:
    """The content of the config file ``path`` named by ``flag``, refused in one line when it does not exist, is
    not readable UTF-8 text, is too large or deep (``yaml_size_problem``), not YAML, has a key twice, a Python
    object's tag, is empty or is no mapping."""
    if not path.is_file():
        raise ValueError(f"{path}: {'not a file' if path.exists() else 'no such file'}; {flag} takes a YAML config "
                         "file")
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
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise ValueError(f"{path}: nests too deeply to be a config (at most {MAX_CONFIG_DEPTH} levels)") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ValueError(f"{path}: not valid YAML, {where}{error.problem}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    if problem := yaml_size_problem(root):
        raise ValueError(f"{path}: {problem}")
    if (twice := duplicate_key(root)) is not None:
        first, again = twice
        raise ValueError(f"{path}: line {again.start_mark.line + 1}, column {again.start_mark.column + 1}: the key "
                         f"{again.value!r:.60} is given twice in one mapping (first on line "
                         f"{first.start_mark.line + 1}); YAML keeps only the last, so the first would be silently "
                         "ignored: keep one")
    # a tag PyYAML's safe loader has no constructor for: a Python object's, or an unknown one
    tagged = next((node for node in yaml_nodes(root) if node.tag not in yaml.SafeLoader.yaml_constructors), None)
    if tagged is not None:
        mark = tagged.start_mark
        raise ValueError(f"{path}: line {mark.line + 1}, column {mark.column + 1}: the YAML tag "
                         f"{tagged.tag.replace(YAML_TAG_PREFIX, '!!')} is refused: a config holds plain values "
                         "(classes are named by class_path and init_args)")
    loaded = yaml.safe_load(text)
    if loaded is None:
        raise ValueError(f"{path}: the config file is empty; it holds options such as trainer:, model: and data:")
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a config file holds a mapping of options (trainer:, model:, data:), not a "
                         f"{type(loaded).__name__}")
    return loaded


def named_yaml_files(config: Any, path: Path) -> list[Path]:
    """The existing ``.yaml``/``.yml`` files the strings of ``config`` name (from here, else from its folder)."""
    found, stack = [], [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node
        elif isinstance(node, str) and node.lower().endswith(YAML_SUFFIXES):
            found += [candidate for candidate in (Path(node), path.parent / node) if is_a_file(str(candidate))][:1]
    return found


def check_yaml_values(args: Sequence[str]) -> None:
    """Refuse, naming the option, a command-line value whose YAML is too large or deep (``yaml_size_problem``)."""
    for index, arg in enumerate(args):
        flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if not equals:
            flag = args[index - 1] if index and args[index - 1].startswith("-") else "a command-line value"
        if not any(mark in value for mark in "*[{-:"):
            continue  # a plain scalar: no alias, no nesting
        try:
            node = yaml.compose(value, Loader=yaml.SafeLoader)
        except RecursionError:
            raise ValueError(f"{flag}: the value nests too deeply to be a value (at most {MAX_CONFIG_DEPTH} "
                             "levels)") from None
        except yaml.YAMLError:
            continue  # not YAML: jsonargparse takes it as a string
        if problem := yaml_size_problem(node):
            raise ValueError(f"{flag}: the value {problem}")


def yaml_nodes(root: Any) -> Iterator[Any]:
    """Each node of a composed YAML document once (an alias is the node it names), in order, without recursion."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack += reversed(_children(node))


def _children(node: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else []


def expanded(root: Any, limit: int) -> tuple[int, int] | None:
    """(size, depth) of a composed YAML document with its aliases expanded: one per node plus each scalar's
    characters (counted up to past ``limit``). None where an alias is inside the node it names."""
    found: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if closing:
            open_nodes.discard(key)
            inner = [found[id(child)] for child in _children(node)]
            size = 1 + (len(str(node.value)) if isinstance(node, yaml.ScalarNode) else sum(s for s, _ in inner))
            found[key] = (min(size, limit + 1), 1 + max((depth for _, depth in inner), default=0))
        elif key in open_nodes:
            return None
        elif key not in found:
            open_nodes.add(key)
            stack += [(node, True), *((child, False) for child in _children(node))]
    return found[id(root)]


def yaml_size_problem(root: Any) -> str | None:
    """What makes a composed YAML document too large to read (``expanded``), or None."""
    if (found := expanded(root, MAX_CONFIG_BYTES)) is None:
        return "holds a YAML alias inside the node it names (it would never end)"
    size, depth = found
    if depth > MAX_CONFIG_DEPTH:
        return f"nests {depth} levels deep (aliases expanded), more than the {MAX_CONFIG_DEPTH} a config may"
    if size > MAX_CONFIG_BYTES:
        return (f"grows past {MAX_CONFIG_BYTES // 2**20} MiB once its YAML aliases (*name) are expanded, more than "
                "a config may hold; write the values out")
    return None


def duplicate_key(root: Any) -> tuple[Any, Any] | None:
    """(first, second) node of the first key given twice in one mapping (PyYAML keeps the last silently)."""
    for node in yaml_nodes(root):
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], Any] = {}
            for key in (key for key, _ in node.value if isinstance(key, yaml.ScalarNode)):
                if (first := seen.setdefault((key.tag, key.value), key)) is not key:
                    return first, key
    return None


def read_config(path: Path) -> Any:
    """The content of a config file ``check_config_files`` accepted (None where it cannot be read now)."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
