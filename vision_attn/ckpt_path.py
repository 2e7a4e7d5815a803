"""``--ckpt_path``: the checkpoint a ``fit``, ``validate``, ``test`` or ``predict`` restores, read by us before
LightningCLI builds anything (weights-only, of the config's model family), its hyper-parameters in today's groups
as the model's config, less the initial-weight options (``checkpoint.INITIAL_WEIGHTS``): the checkpoint holds those
weights, so it runs anywhere with only the data. ``last`` with no checkpoint, and a model registry, are refused.
"""

from __future__ import annotations

import importlib
import logging
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from vision_attn.checkpoint import (
    KIND_KEY,
    hyper_parameters,
    load_file,
    require_kind,
    without_initial_weights,
)
from vision_attn.errors import CheckpointError
from vision_attn.option_groups import OptionGroup

log = logging.getLogger(__name__)

NAMED_CHECKPOINTS = ("last", "best", "hpc")  # --ckpt_path values Lightning resolves itself, read by SafeCheckpointIO


def refuse_registry(ckpt_path: str) -> None:
    """Refuse ``--ckpt_path registry[:NAME]``: a file Lightning fetches is what could carry code."""
    if ckpt_path.lower() == "registry" or ckpt_path.lower().startswith("registry:"):
        raise CheckpointError(f"--ckpt_path {ckpt_path}: checkpoints are not fetched from a model registry, because "
                              "loading one can run code it carries; download it, check it, and pass the local file")


def model_class(class_path: str) -> type | None:
    """The class a config's ``model.class_path`` names (None if it cannot be imported)."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return None  # LightningCLI reports a class it cannot import in its own words


def model_kind(class_path: str) -> str | None:
    """The checkpoint kind of the task a config's ``model.class_path`` names (None if it is not ours)."""
    return getattr(model_class(class_path), "kind", None)


def restored_model(path: str | Path, class_path: str, *, source: str) -> dict[str, Any] | None:
    """The model config (without the initial-weight options) of the checkpoint at the local ``path`` (None: it has
    no hyper-parameters), refused naming ``source`` when of another family than ``class_path``."""
    loaded = load_file(path)
    kind = loaded.get(KIND_KEY)
    if wanted := model_kind(class_path):
        require_kind(kind, wanted, source=source, training=True)
    hparams = hyper_parameters(loaded)
    return {"class_path": class_path, "init_args": without_initial_weights(kind, hparams)} if hparams else None


# The model's option group that a checkpoint's user may change: how captions are searched, not what was learnt
CHANGEABLE_GROUPS = ("decoding",)


def changed_options(restored: dict[str, Any], given: dict[str, Any], task: type | None,
                    kind: str | None) -> Iterator[tuple[str, Any, Any]]:
    """(option path, given value, the checkpoint's) for each model option outside ``CHANGEABLE_GROUPS`` that
    ``given`` (the init args parsed without defaults) sets otherwise than ``restored``. A group is compared as
    ``OptionGroup.coerce`` reads it, so the same options written another way are the same; the initial-weight
    options, which a restored checkpoint never reads, are not compared."""
    given = without_initial_weights(kind, given) if kind else dict(given)
    try:
        hints = typing.get_type_hints(task.__init__) if task is not None else {}
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: compare the options as given
        hints = {}
    for name, value in given.items():
        if name in CHANGEABLE_GROUPS:
            continue
        theirs, group = restored.get(name), hints.get(name)
        if isinstance(group, type) and issubclass(group, OptionGroup) and isinstance(value, Mapping) and \
                isinstance(theirs, Mapping | type(None)):
            checkpoint_group = group.coerce(theirs)
            asked = group.coerce({**(theirs or {}), **value})
            yield from ((f"{name}.{key}", getattr(asked, key), getattr(checkpoint_group, key)) for key in value
                        if getattr(asked, key) != getattr(checkpoint_group, key))
        elif value != theirs:
            yield name, value, theirs


def refuse_changed_options(restored: dict[str, Any], given: dict[str, Any], args: list[str], ckpt_path: str) -> None:
    """Refuse the first model option (``changed_options``) that the command line ``args`` sets otherwise than the
    checkpoint; those of config files are logged in one line and the checkpoint's used, so the configs a run was
    fitted with still test it."""
    class_path = str(restored["class_path"])
    on_command_line, in_configs = {arg.partition("=")[0] for arg in args}, []  # the names given, without values
    for path, asked, theirs in changed_options(restored["init_args"], given, model_class(class_path),
                                               model_kind(class_path)):
        if {f"--model.init_args.{path}", f"--model.{path}"} & on_command_line:
            raise ValueError(f"--model.init_args.{path}: {shown(asked)}, but --ckpt_path {ckpt_path} was fitted "
                             f"with {shown(theirs)}, and its model options are the model's; give its value or leave "
                             f"this option out (only the {', '.join(CHANGEABLE_GROUPS)} options can be changed)")
        in_configs.append(f"model.init_args.{path} ({shown(asked)} there, {shown(theirs)} in the checkpoint)")
    if in_configs:
        log.warning("the config files set %d model option%s otherwise than --ckpt_path %s, whose values are used "
                    "(only the %s options can be changed): %s", len(in_configs), "s" * (len(in_configs) > 1),
                    ckpt_path, ", ".join(CHANGEABLE_GROUPS), "; ".join(in_configs[:3]) +
                    ("; ..." if len(in_configs) > 3 else ""))


def shown(value: Any) -> str:
    """An option's value for a one-line message, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def with_changes(restored: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The model config ``restored`` from a checkpoint with ``given``'s ``CHANGEABLE_GROUPS`` options over its own."""
    init_args = dict(restored["init_args"])
    for group in CHANGEABLE_GROUPS:
        changes = given.get(group)
        if isinstance(changes, dict) and changes and isinstance(init_args.get(group, {}), dict):
            init_args[group] = {**(init_args.get(group) or {}), **changes}
    return {**restored, "init_args": init_args}


def checkpoint_folder(trainer: L.Trainer, callback: Any) -> Path:
    """Where a ModelCheckpoint will write, by its documented rule (``dirpath``, the first logger's ``log_dir``, or
    ``default_root_dir``, then ``checkpoints``): Lightning resolves it only when the fit starts."""
    if getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    if trainer.loggers and getattr(trainer.loggers[0], "log_dir", None):
        return Path(trainer.loggers[0].log_dir) / "checkpoints"
    return Path(trainer.default_root_dir) / "checkpoints"


def require_last_checkpoint(trainer: L.Trainer, subcommand: str) -> None:
    """Refuse ``--ckpt_path last`` without a last checkpoint, naming where it was looked for (Lightning would warn,
    then fit from scratch or evaluate untrained weights). Lightning (2.6) resumes from each ModelCheckpoint's
    ``last*`` files, and the OnExceptionCheckpoints' files."""
    found, folders = [], []
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            found += [Path(callback.ckpt_path)] if Path(callback.ckpt_path).is_file() else []
        elif isinstance(callback, ModelCheckpoint):
            folder = checkpoint_folder(trainer, callback)
            folders.append(folder)
            found += [path for path in sorted(folder.iterdir()) if path.suffix == callback.FILE_EXTENSION
                      and path.stem.startswith(callback.CHECKPOINT_NAME_LAST)] if folder.is_dir() else []
    if found:
        return
    where = f"in {', '.join(str(folder) for folder in folders)}" if folders else \
        "to look for: the config has no ModelCheckpoint (trainer.callbacks) that writes one"
    raise FileNotFoundError(f"--ckpt_path last: no last checkpoint {where}; pass the checkpoint's path, or "
                            + ("fit without --ckpt_path to start anew" if subcommand == "fit" else
                               f"{subcommand} another run's checkpoint"))
