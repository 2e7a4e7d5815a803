"""``vision-attn fit | validate | test | predict``: LightningCLI with the DataModule → model links, the option
groups' docs in ``--help``, atomic checkpoint writes, a ``last.ckpt`` that holds the final weights, a progress bar
redrawn at most 5 times a second, and ``--ckpt_path`` checked and read safely. A run that restores a checkpoint
(``--ckpt_path``) never reads the files its fit started from (the options of ``checkpoint.INITIAL_WEIGHTS``):
the checkpoint holds those weights, so it runs anywhere with only the data.

LightningCLI's public hooks are overridden (``parse_arguments``, ``add_arguments_to_parser``,
``instantiate_trainer``), and two private methods of Lightning 2.6, each with a test: ``_parse_ckpt_path``, which
reads a checkpoint's hyper-parameters into the model's config (here weights-only, upgraded to today's groups, and
without the options that only matter when a fit starts), and ``TQDMProgressBar._should_update`` (the paced bar).
"""

from __future__ import annotations

import importlib
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jsonargparse
import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    ProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from vision_attn.checkpoint import (
    INITIAL_WEIGHTS,
    KIND_KEY,
    load_file,
    local_path,
    require_kind,
    upgrade,
    without_initial_weights,
)
from vision_attn.config_errors import OneLineErrors
from vision_attn.io import replace_atomically

# A dataclass field's doc is the string under it: jsonargparse shows it in --help (the option groups)
jsonargparse.set_parsing_settings(docstring_parse_attribute_docstrings=True)

# DataModule attribute -> model argument. A link is skipped when the DataModule lacks the attribute, but
# a model that lacks the argument gets an error: every model must accept every target its data can send.
LINKED_FROM_DATA = {
    "image_format": "image",
    "num_classes": "num_classes",
    "class_names": "class_names",
    "colour_names": "colour_names",
    "vocab_tokens": "vocabulary",
    "object_names": "objects",
}
NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")  # --ckpt_path values Lightning resolves itself
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 CPUs with bf16 arithmetic


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file), less those whose
    kernels torch and oneDNN were told not to use: ``ATEN_CPU_CAPABILITY`` below AVX-512 or ``ONEDNN_MAX_CPU_ISA``
    below AVX512_CORE drop the AVX-512 and AMX flags, an ``ONEDNN_MAX_CPU_ISA`` of AVX-512 without BF16, FP16 or
    AMX drops the bf16 and AMX ones (``scripts/slower_cpu.sh`` runs an AVX-512 machine as one without)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    below_avx512 = aten in ("default", "avx2") or (
        onednn not in ("", "ALL") and not onednn.startswith(("AVX512", "AVX10")) and "AMX" not in onednn)
    if below_avx512:
        return {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    if onednn.startswith("AVX512") and not any(part in onednn for part in ("BF16", "FP16", "AMX")):
        return {flag for flag in flags if flag != "avx512_bf16" and not flag.startswith("amx")}
    return flags


def bf16_warning(precision: str, on_cpu: bool, flags: set[str]) -> str | None:
    """What to tell a user who trains in bf16 on a CPU without bf16 arithmetic (None when it does not apply).
    There every bf16 convolution and matmul is emulated: VGG-19 at 224 px ran 80× slower than in fp32 on an
    AVX2 machine (114.7 s against 1.43 s for 4 images)."""
    if not on_cpu or "bf16" not in str(precision) or not flags or flags & set(NATIVE_BF16_FLAGS):
        return None
    return (f"precision {precision} on a CPU without bf16 arithmetic (none of {', '.join(NATIVE_BF16_FLAGS)} in "
            "its flags): bf16 convolutions and matmuls are emulated here and can run tens of times slower than "
            "fp32 (VGG-19 at 224 px: 80× slower on an AVX2 CPU); use --trainer.precision 32-true")


class SafeCheckpointIO(TorchCheckpointIO):
    """Checkpoints read only through ``checkpoint.load_file`` (weights-only, local), and written to a temporary
    file beside the target, then renamed: a crash (even SIGKILL) mid-write leaves the previous checkpoint whole.
    Remote paths (``s3://`` ...) keep Lightning's own writer; they are never read."""

    def save_checkpoint(self, checkpoint: dict, path: str | Path, storage_options: object | None = None) -> None:
        """Write ``checkpoint`` to a local ``path`` atomically (a remote one with Lightning's writer)."""
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        replace_atomically(path, lambda file: torch.save(checkpoint, file))

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
        """Read a local checkpoint weights-only with ``checkpoint.load_file`` (on the CPU unless told otherwise)."""
        return load_file(path, map_location=map_location or "cpu")


class PacedProgressBar(TQDMProgressBar):
    """Lightning's tqdm bars, redrawn at most every ``interval`` seconds (and at each bar's end) instead of at
    every batch. Redrawing a bar and its metrics took ~2 ms of each ~30 ms step of the scene encoder's
    pretraining on 2 cores, time its 4-minute budget then did not train. The CLI uses it in place of
    Lightning's default bar; a progress bar set in the config is kept as it is."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__()
        self.interval = interval
        self._drawn_at = float("-inf")

    def _should_update(self, current: int, total: int) -> bool:
        if not super()._should_update(current, total):
            return False
        now = time.monotonic()
        if current == total or now - self._drawn_at >= self.interval:
            self._drawn_at = now
            return True
        return False


class FinalWeightsInLast(L.Callback):
    """``last.ckpt`` holds the weights the fit ended with. Lightning (2.6) writes a ModelCheckpoint's ``last``
    only at a validation where its monitored top-k checkpoint is written too, so a fit that ``max_time`` stops
    after a validation that did not improve on the best kept an earlier step as "last" (on the slower machine's
    stand-in, the scenes captioner's step 1,250 of 1,543). At the end of fitting, when no checkpoint was
    written at the final step, each ModelCheckpoint with ``save_last: true`` writes its ``last`` again (a
    ``save_last: link`` is a link to a top-k file, left as it is)."""

    def __init__(self) -> None:
        self.saved_at_step = -1

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """Note the step of the checkpoint being written."""
        self.saved_at_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write each ``save_last: true`` checkpoint's ``last`` again unless one was written at the final step."""
        if trainer.fast_dev_run or self.saved_at_step == trainer.global_step:
            return
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "save_last", None) is True and getattr(callback, "last_model_path", ""):
                trainer.save_checkpoint(callback.last_model_path)


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


def clear_initial_weights(model: Any, kind: str | None) -> None:
    """Clear, in a config's ``model`` (class path and init args), the options that say where a fit's first
    weights come from (``checkpoint.INITIAL_WEIGHTS`` of ``kind``): None, or False for a flag."""
    for target in INITIAL_WEIGHTS.get(kind or "", ()):
        key = f"init_args.{target}"
        try:
            value = model[key]
        except (KeyError, TypeError):
            continue
        model[key] = False if isinstance(value, bool) else None


def last_checkpoints(trainer: L.Trainer) -> tuple[list[Path], list[Path]]:
    """(the checkpoints ``--ckpt_path last`` resumes from, the folders looked in), as Lightning (2.6) finds them:
    each ModelCheckpoint's ``last`` files (``last.ckpt``, ``last-v1.ckpt`` ...) in its folder, and the
    files of the OnExceptionCheckpoints."""
    found, folders = [], []
    for callback in trainer.callbacks:
        if isinstance(callback, OnExceptionCheckpoint):
            found += [Path(callback.ckpt_path)] if Path(callback.ckpt_path).is_file() else []
        elif isinstance(callback, ModelCheckpoint):
            folder = checkpoint_folder(trainer, callback)
            folders.append(folder)
            last = re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?")
            found += [path for path in sorted(folder.iterdir()) if path.suffix == callback.FILE_EXTENSION
                      and last.match(path.stem)] if folder.is_dir() else []
    return found, folders


def checkpoint_folder(trainer: L.Trainer, callback: Any) -> Path:
    """Where a ModelCheckpoint will write, as Lightning resolves it: its ``dirpath``, else the first logger's
    ``log_dir/checkpoints`` (a versioned logger picks a new version), else ``default_root_dir/checkpoints``."""
    if getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    if trainer.loggers and getattr(trainer.loggers[0], "log_dir", None):
        return Path(trainer.loggers[0].log_dir) / "checkpoints"
    return Path(trainer.default_root_dir) / "checkpoints"


class VisionAttnCLI(OneLineErrors, LightningCLI):
    """LightningCLI with the links of ``LINKED_FROM_DATA``, a ``--ckpt_path`` check, and its refusals in one line
    naming the option or the config file (``config_errors.OneLineErrors``)."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Link the DataModule's ``LINKED_FROM_DATA`` into the model's arguments, and add ``--overwrite``."""
        for source, target in LINKED_FROM_DATA.items():
            parser.link_arguments(f"data.{source}", f"model.init_args.{target}", apply_on="instantiate")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: start anew over the checkpoints of an earlier run in the same folder, "
                                 "replacing them (without it, such a fit is refused)")

    def require_last_checkpoint(self) -> None:
        """Refuse ``--ckpt_path last`` when there is no last checkpoint, naming where it was looked for: Lightning
        would only warn, then fit from scratch (or evaluate untrained weights)."""
        if self.config[self.subcommand].get("ckpt_path") != "last":
            return
        found, folders = last_checkpoints(self.trainer)
        if found:
            return
        where = f"in {', '.join(str(folder) for folder in folders)}" if folders else \
            "to look for: the config has no ModelCheckpoint (trainer.callbacks) that writes one"
        raise FileNotFoundError(f"--ckpt_path last: no last checkpoint {where}; pass the checkpoint's path, or "
                                + ("fit without --ckpt_path to start anew" if self.subcommand == "fit" else
                                   f"{self.subcommand} another run's checkpoint"))

    def before_validate(self) -> None:
        """Refuse ``--ckpt_path last`` with no last checkpoint (``require_last_checkpoint``)."""
        self.require_last_checkpoint()

    before_test = before_predict = before_validate

    def before_fit(self) -> None:
        """Refuse ``--ckpt_path last`` with nothing to resume (``require_last_checkpoint``), and a fresh fit whose
        checkpoint folder holds an earlier run's checkpoints: replacing them silently loses that run. Resuming
        (``--ckpt_path``) and ``--overwrite true`` go ahead."""
        self.require_last_checkpoint()
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

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse, then check ``--ckpt_path`` before LightningCLI takes the model's hyper-parameters from it: the
        file must be a weights-only checkpoint of the model family the config trains (else the config's data
        meets another model). ``predict`` needs a checkpoint, and a task that writes predictions."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if subcommand == "predict":
            require_predictions(self.config[subcommand], ckpt_path)
        if ckpt_path and ckpt_path not in NAMED_CHECKPOINTS:
            local = str(local_path(ckpt_path))  # a remote path is refused here, before Lightning would fetch it
            self.config[subcommand]["ckpt_path"] = local
            found = load_file(local).get(KIND_KEY)
            model = self.config[subcommand].get("model") or {}
            class_path = model.get("class_path", "") if isinstance(model, dict) else getattr(model, "class_path", "")
            wanted = model_kind(str(class_path))
            if wanted:
                require_kind(found, wanted, source=ckpt_path, training=True)

    def _parse_ckpt_path(self) -> None:
        """Lightning's own (2.6) puts the checkpoint's hyper-parameters into the model's config, read with
        ``torch.load``; here they are read weights-only (``checkpoint.load_file``), brought to today's groups
        (a checkpoint written before them still tests), and the options that say where a fit's first weights come
        from are cleared: the checkpoint's weights replace them, so it runs on any machine with only the data.
        They are cleared in the config too, for ``last`` and the other names Lightning resolves later."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path:
            return
        model = self.config[subcommand].get("model")
        if model is not None:
            clear_initial_weights(model, model_kind(str(model.get("class_path", ""))))
        if not Path(ckpt_path).is_file():
            return
        loaded = upgrade(load_file(ckpt_path))
        hparams = loaded.get("hyper_parameters") or {}
        if hparams:
            hparams = without_initial_weights(loaded.get(KIND_KEY), hparams)
            model = {"class_path": self.config[subcommand]["model"]["class_path"], "init_args": hparams}
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        """The configured Trainer, whose checkpoints are read safely and written atomically by ``SafeCheckpointIO``
        (added to the config's plugins unless they hold a CheckpointIO of their own)."""
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = (config.get("trainer") or {}).get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list | tuple) else [plugins]
        if "plugins" not in kwargs and not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            kwargs["plugins"] = [*plugins, SafeCheckpointIO()]
        configured_bar = holds_progress_bar((config.get("trainer") or {}).get("callbacks"))  # read before Lightning
        trainer = super().instantiate_trainer(**kwargs)  # ... adds its default bar to that same list
        bar = trainer.progress_bar_callback
        if type(bar) is TQDMProgressBar and bar.refresh_rate == 1 and not configured_bar:
            trainer.callbacks[trainer.callbacks.index(bar)] = PacedProgressBar()  # Lightning's default bar
        if any(getattr(callback, "save_last", None) is True for callback in trainer.checkpoint_callbacks):
            trainer.callbacks.append(FinalWeightsInLast())
        if not trainer.loggers:  # the trainer bases log the learning rate; with --trainer.logger false, nowhere to
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        warning = bf16_warning(trainer.precision, isinstance(trainer.accelerator, CPUAccelerator), cpu_flags())
        if warning:
            rank_zero_warn(warning)
        return trainer


def require_predictions(config: Any, ckpt_path: str | None) -> None:
    """Refuse ``predict`` without ``--ckpt_path`` (it would predict with untrained weights) or for a task that
    writes no predictions (``tasks/predictions.py``)."""
    model = config.get("model")
    class_path = str(model.get("class_path", "")) if model is not None else ""
    task = model_class(class_path)
    if task is not None and not hasattr(task, "save_predictions"):
        raise ValueError(f"predict: {class_path} writes no predictions; predict runs a captioner "
                         "(vision_attn.tasks.CaptionerTask) or a classifier (ViTTask, ConvNetTask)")
    if not ckpt_path:
        raise ValueError("predict needs --ckpt_path: the checkpoint whose predictions to write "
                         "(e.g. runs/<run>/checkpoints/best.ckpt)")


def holds_progress_bar(callbacks: Any) -> bool:
    """Whether the configured callbacks (a callback, a list of them, or None) hold a progress bar."""
    callbacks = callbacks if isinstance(callbacks, list | tuple) else [callbacks]
    return any(isinstance(callback, ProgressBar) for callback in callbacks)


def run_lightning(args: Sequence[str] | None) -> None:
    """LightningCLI on ``args`` (``sys.argv`` when None): the model and data are picked by ``class_path``.
    Lightning's refusal of a setting (``MisconfigurationException``) becomes a one-line user error."""
    try:
        VisionAttnCLI(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            auto_configure_optimizers=False,
        )
    except MisconfigurationException as error:
        raise ValueError(f"Lightning refused a setting: {error}") from None
    end_process_group()


def end_process_group() -> None:
    """End the torch.distributed process group a finished DDP run leaves behind, on this rank. Lightning ends only
    an NCCL group (at exit); a Gloo group left to the interpreter's shutdown can abort the process after a run
    that succeeded ("terminate called without an active exception", exit status -6: seen once in a two-process
    CPU ``predict`` beside the other tests). PyTorch asks each process to call ``destroy_process_group`` when it
    is done with it; an NCCL group ended here is not ended again at exit."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def cache_features(args: Sequence[str]) -> None:
    """``vision-attn cache-features --config C [overrides]``: fill the feature cache of every split ahead of
    ``fit``, as ``fit`` would (the DataModule's ``feature_cache``, the model's frozen encoder part), printing the
    disk size first and a progress bar per split. One process; ``fit`` under DDP fills in parallel instead."""
    cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, args=list(args), run=False, auto_configure_optimizers=False,
                        save_config_callback=None)
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
