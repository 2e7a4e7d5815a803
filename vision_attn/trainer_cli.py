"""``vision-attn fit | validate | test | predict`` and ``cache-features``: LightningCLI with the DataModule → model
links, the option groups' docs in ``--help``, ``--ckpt_path`` read by us (``ckpt_path.py``), the Trainer's additions
(``trainer_callbacks.py``) and its refusals in one line (``config_errors.py``), through LightningCLI's public hooks.

Lightning (2.6) reads ``--ckpt_path``'s hyper-parameters into the model's config itself, not upgraded, between
``parse_arguments`` and ``before_instantiate_classes``, with no public switch to stop it; so ``parse_arguments``
reads them and holds the path back from the config until ``before_instantiate_classes``.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Sequence
from typing import Any

import jsonargparse
import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_warn

from vision_attn.checkpoint import clear_initial_weights, local_path
from vision_attn.ckpt_path import (
    NAMED_CHECKPOINTS,
    checkpoint_folder,
    model_class,
    model_kind,
    refuse_changed_options,
    refuse_registry,
    require_last_checkpoint,
    restored_model,
    with_changes,
)
from vision_attn.cli_arguments import nulls_to_groups
from vision_attn.config_errors import OneLineErrors, given_argv
from vision_attn.hardware import bf16_warning, cpu_flags
from vision_attn.option_groups import OptionGroup
from vision_attn.trainer_callbacks import BatchCountTrainer, FinalWeightsInLast, PacedProgressBar, SafeCheckpointIO

# DataModule attribute -> model argument. A link is skipped when the DataModule lacks the attribute, but
# a model that lacks the argument gets an error: every model must accept every target its data can send.
LINKED_FROM_DATA = {"image_format": "image", "num_classes": "num_classes", "class_names": "class_names",
                    "colour_names": "colour_names", "vocab_tokens": "vocabulary", "object_names": "objects"}


class VisionAttnCLI(OneLineErrors, LightningCLI):
    """LightningCLI with the links of ``LINKED_FROM_DATA``, ``--ckpt_path`` read by us, the Trainer's additions,
    and its refusals in one line naming the option or the config file (``config_errors.OneLineErrors``)."""

    held_ckpt_path: str | None = None  # --ckpt_path, out of the config between parse_arguments and instantiation

    def __init__(self, *args: Any, trainer_class: type[L.Trainer] = BatchCountTrainer, **kwargs: Any) -> None:
        super().__init__(*args, trainer_class=trainer_class, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Link the DataModule's ``LINKED_FROM_DATA`` into the model's arguments, and add ``--overwrite``."""
        for source, target in LINKED_FROM_DATA.items():
            parser.link_arguments(f"data.{source}", f"model.init_args.{target}", apply_on="instantiate")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: start anew over the checkpoints of an earlier run in the same folder, "
                                 "replacing them (without it, such a fit is refused)")

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse, then read ``--ckpt_path`` (``predict`` needs one): a file's hyper-parameters become the model's
        config (``ckpt_path.py``); the initial-weight options are cleared for the names Lightning resolves too. The
        path is held back (``held_ckpt_path``) so that Lightning does not read the hyper-parameters again."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        ckpt_path, model = config.get("ckpt_path"), config.get("model")
        class_path = str(model.get("class_path", "")) if model is not None else ""
        if subcommand == "predict":
            require_predictions(class_path, ckpt_path)
        if not ckpt_path:
            return
        if model is not None and model.get("init_args") is not None:
            clear_initial_weights(model_kind(class_path), model["init_args"])
        refuse_registry(str(ckpt_path))
        if ckpt_path not in NAMED_CHECKPOINTS:
            local = str(local_path(ckpt_path))  # a remote path is refused here, before Lightning would fetch it
            restored = restored_model(local, class_path, source=ckpt_path)
            if restored and class_path:
                explicit = parser.parse_object(args, defaults=False) if isinstance(args, dict) else \
                    parser.parse_args(args, defaults=False)
                changes = (explicit[subcommand].get("model") or {}).get("init_args") or {}
                changes = changes.as_dict() if isinstance(changes, jsonargparse.Namespace) else dict(changes)
                refuse_changed_options(restored, changes, given_argv(args), ckpt_path)
                self.config = parser.parse_object({subcommand: {"model": with_changes(restored, changes)}},
                                                  self.config)
            ckpt_path = local
        self.held_ckpt_path = ckpt_path
        self.config[subcommand]["ckpt_path"] = None

    def before_instantiate_classes(self) -> None:
        """Put ``--ckpt_path`` back into the config, and check the model's and DataModule's option groups, so that
        a wrong option is one line before the DataModule does any work."""
        if self.held_ckpt_path is not None:
            self.config[self.subcommand]["ckpt_path"] = self.held_ckpt_path
            self.held_ckpt_path = None
        config = self.config[self.subcommand] if self.subcommand else self.config
        for key in ("model", "data"):
            if isinstance(config.get(key), jsonargparse.Namespace):
                check_option_groups(config[key])

    def before_validate(self) -> None:
        """Refuse ``--ckpt_path last`` with no last checkpoint (``ckpt_path.require_last_checkpoint``)."""
        if self.config[self.subcommand].get("ckpt_path") == "last":
            require_last_checkpoint(self.trainer, self.subcommand)

    before_test = before_predict = before_validate

    def before_fit(self) -> None:
        """Refuse ``--ckpt_path last`` with nothing to resume, and a fresh fit (without ``--overwrite true``) whose
        checkpoint folder holds an earlier run's checkpoints, which it would silently replace."""
        self.before_validate()  # --ckpt_path last
        config = self.config[self.subcommand]
        if config.get("ckpt_path") or config.get("overwrite"):
            return
        for callback in self.trainer.checkpoint_callbacks:
            folder = checkpoint_folder(self.trainer, callback)
            found = sorted(path.name for path in folder.glob("*.ckpt")) if folder.is_dir() else []
            if found:
                raise FileExistsError(f"{folder}: holds the checkpoints of an earlier run ({', '.join(found)}); resume "
                                      "it with --ckpt_path last, move it away to keep it, or replace it with "
                                      "--overwrite true")

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The configured Trainer with ``safe_plugins``, a ``PacedProgressBar`` unless the config sets a bar,
        ``FinalWeightsInLast`` where a ModelCheckpoint saves its last, no LearningRateMonitor without a logger, and
        a warning for bf16 on a CPU without bf16 arithmetic."""
        config = (self.config_init[self.subcommand] if self.subcommand else self.config_init).get("trainer") or {}
        plugins, callbacks = (list(found) if isinstance(found, list | tuple) else [found] if found else []
                              for found in (config.get("plugins"), config.get("callbacks")))  # as lists
        if "plugins" not in kwargs:
            kwargs["plugins"] = safe_plugins(plugins)
        if "callbacks" not in kwargs and config.get("enable_progress_bar") is not False and \
                not any(isinstance(callback, ProgressBar) for callback in callbacks):
            kwargs["callbacks"] = [*callbacks, PacedProgressBar()]  # in place of Lightning's default bar
        trainer = super().instantiate_trainer(**kwargs)
        if any(getattr(callback, "save_last", None) is True for callback in trainer.checkpoint_callbacks):
            trainer.callbacks.append(FinalWeightsInLast())
        if not trainer.loggers:  # the trainer bases log the learning rate; with --trainer.logger false, nowhere to
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        warning = bf16_warning(trainer.precision, isinstance(trainer.accelerator, CPUAccelerator), cpu_flags())
        if warning:
            rank_zero_warn(warning)
        return trainer


def safe_plugins(plugins: list[Any]) -> list[Any]:
    """``trainer.plugins`` with every checkpoint read by ``SafeCheckpointIO``: added (writing too) when they name no
    CheckpointIO, else wrapped around the one they name, which still writes."""
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        return [*plugins, SafeCheckpointIO()]
    return [plugin if isinstance(plugin, SafeCheckpointIO) or not isinstance(plugin, CheckpointIO) else
            SafeCheckpointIO(writer=plugin) for plugin in plugins]


def check_option_groups(section: jsonargparse.Namespace) -> None:
    """Coerce each option group a config gives a class (``class_path``, ``init_args``): a wrong option is one line."""
    cls = model_class(str(section.get("class_path") or ""))
    init_args = section.get("init_args")
    if cls is None or not isinstance(init_args, jsonargparse.Namespace):
        return
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: the class checks itself when built
        return
    for name, value in init_args.as_dict().items():
        group = hints.get(name)
        if isinstance(group, type) and issubclass(group, OptionGroup) and isinstance(value, dict | type(None)):
            group.coerce(value)


def require_predictions(class_path: str, ckpt_path: str | None) -> None:
    """Refuse ``predict`` without ``--ckpt_path`` (untrained weights), or of a task that writes no predictions."""
    task = model_class(class_path)
    if task is not None and not hasattr(task, "save_predictions"):
        raise ValueError(f"predict: {class_path} writes no predictions; predict runs a captioner "
                         "(vision_attn.tasks.CaptionerTask) or a classifier (ViTTask, ConvNetTask)")
    if not ckpt_path:
        raise ValueError("predict needs --ckpt_path: the checkpoint whose predictions to write "
                         "(e.g. runs/<run>/checkpoints/best.ckpt)")


def run_lightning(args: Sequence[str] | None) -> None:
    """LightningCLI on ``args`` (``sys.argv[1:]`` when None), the model and data picked by ``class_path``; Lightning's
    refusal of a setting (``MisconfigurationException``) is a one-line user error."""
    if args is None:  # from the command line, sys.argv is rewritten in place (LightningCLI warns of both ways)
        sys.argv[1:] = nulls_to_groups(sys.argv[1:])
    arguments = None if args is None else nulls_to_groups(args)
    read_docs_only_for_help(given_argv(arguments))
    try:
        VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                      save_config_kwargs={"overwrite": True}, args=arguments, auto_configure_optimizers=False)
    except MisconfigurationException as error:
        raise ValueError(f"Lightning refused a setting: {error}") from None
    end_process_group()


def read_docs_only_for_help(args: Sequence[str]) -> None:
    """Have jsonargparse read the options' docs only when ``args`` ask for a help that shows them: a dataclass
    field's doc is the string under it (the option groups), and reading those strings means parsing the sources
    of every class the parser takes, Trainer's among them."""
    jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=asks_for_help(args))


def asks_for_help(args: Sequence[str]) -> bool:
    """Whether ``args`` ask for a help text with the options' docs: ``--help``, a class's ``--model.help``-style
    help, or ``--print_config`` with comments."""
    return any(arg in ("-h", "--help") or arg.split("=", 1)[0].endswith(".help")
               or (arg.startswith("--print_config") and "comments" in arg) for arg in args)


def end_process_group() -> None:
    """End the torch.distributed process group a finished DDP run leaves on this rank, as PyTorch asks: Lightning
    ends only an NCCL group, and a Gloo group left to the interpreter's shutdown can abort a run that succeeded."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cache_features(args: Sequence[str]) -> None:
    """``vision-attn cache-features --config C [overrides]``: fill every split's feature cache ahead of ``fit``, as
    ``fit`` would (in one process), printing the disk size first and a progress bar per split."""
    arguments = nulls_to_groups(list(args))
    read_docs_only_for_help(arguments)
    # LightningCLI warns when given args while sys.argv holds any: the tool's arguments stand in for the command
    # line while it reads them, and its help names the tool
    command_line, sys.argv = sys.argv, [sys.argv[0], *arguments]
    try:
        cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, run=False, auto_configure_optimizers=False,
                            save_config_callback=None, parser_kwargs={"prog": "vision-attn cache-features"})
    finally:
        sys.argv = command_line
    model, datamodule = cli.model, cli.datamodule
    options = getattr(datamodule, "feature_cache", None)
    if options is None or not options.folder:
        raise ValueError("cache-features: the config sets no data.init_args.feature_cache.folder (and the model no "
                         "frozen encoder, encoder.trainable_stages); nothing to cache")
    part = getattr(model, "frozen_encoder_part", lambda: None)()
    if part is None:
        raise ValueError("feature_cache needs a frozen encoder, whose output never changes: set the model's "
                         "encoder.trainable_stages to 0 (all frozen) or to fewer stages than the trunk has")
    caches = datamodule.feature_caches(part, ("train", "val", "test"))
    total = sum(cache.total_bytes for cache in caches.values())
    first = next(iter(caches.values()))
    print(f"feature cache: {sum(c.count for c in caches.values())} images x {first.bytes_per_image / 1000:.1f} KB = "
          f"{total / 1e6:.1f} MB under {options.folder} ({sum(len(c.missing()) for c in caches.values())} of "
          f"{sum(c.num_shards for c in caches.values())} shards to fill)", flush=True)
    datamodule.fill_feature_caches(part, caches, device=cli.trainer.strategy.root_device)
    for role, cache in caches.items():
        print(f"{role}: {cache.count} images in {cache.folder}")
