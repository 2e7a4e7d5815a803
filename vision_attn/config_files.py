"""The config files of ``fit``, ``validate``, ``test``, ``predict`` and ``cache-features``: found on the command line
(``--config``/``-c``, and a ``--trainer``/``--model``/``--data`` value that is a file), and checked before
LightningCLI reads them. One that does not exist, is not UTF-8 text, is too large, is not YAML, is empty, is not a
mapping or is tagged with a Python object is refused in one line naming it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAGS = ("--config", "-c")
SECTION_FLAGS = ("--trainer", "--model", "--data")  # these take a config file of their section too
MAX_CONFIG_BYTES = 16 * 2**20  # a config is a few KB; more is not one
YAML_TAG_PREFIX = "tag:yaml.org,2002:"  # how PyYAML names the ``!!`` tags


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
    """Refuse, in one line naming it, a config file of ``args`` that does not exist or is not readable, not UTF-8
    text, larger than ``MAX_CONFIG_BYTES``, not YAML, empty, not a mapping, or tagged with a Python object."""
    for flag, path in config_files(args):
        check_config_file(flag, path)


def check_config_file(flag: str, path: Path) -> None:
    """``check_config_files`` for one file, named by ``flag``."""
    import yaml

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
        tagged = next(refused_tags(yaml.compose(text, Loader=yaml.SafeLoader)), None)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ValueError(f"{path}: not valid YAML, {where}{error.problem}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
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


def refused_tags(node: Any) -> Iterator[Any]:
    """The nodes of a composed YAML document (``yaml.compose``) whose tag PyYAML's safe loader has no constructor
    for (a Python object's, or an unknown one), in document order."""
    import yaml

    if node is None:
        return
    if node.tag not in yaml.SafeLoader.yaml_constructors:
        yield node
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from refused_tags(item)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield from refused_tags(key)
            yield from refused_tags(value)


def read_config(path: Path) -> Any:
    """The content of a config file ``check_config_files`` accepted (None where it cannot be read now)."""
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
