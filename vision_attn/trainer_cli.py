"""``vision-attn fit | validate | test | predict``: LightningCLI with the DataModule → model links, atomic
checkpoint writes, a ``last.ckpt`` that holds the final weights, a progress bar redrawn at most 5 times a second,
no second validation past ``max_time``, and a check of ``--ckpt_path`` before Lightning reads it. Only public
LightningCLI hooks are overridden (``parse_arguments``, ``add_arguments_to_parser``, ``instantiate_trainer``);
the paced bar overrides ``TQDMProgressBar._should_update`` (Lightning 2.6), the one private method used, which
its test calls directly.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_warn

from vision_attn.checkpoint import KIND_KEY, load_file, local_path, require_kind
from vision_attn.io import replace_atomically
from vision_attn.task import budget_timer

# DataModule attribute -> model argument. A link is skipped when the DataModule lacks the attribute, but
# a model that lacks the argument gets an error: every model must accept every target its data can send.
LINKED_FROM_DATA = {
    "num_classes": "num_classes",
    "class_names": "class_names",
    "in_chans": "in_chans",
    "mean": "mean",
    "std": "std",
    "image_size": "image_size",
    "vocab_tokens": "vocabulary",
    "object_classes": "object_classes",
    "object_colours": "object_colours",
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
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        replace_atomically(path, lambda file: torch.save(checkpoint, file))

    def load_checkpoint(self, path: str | Path, map_location: Any = None, weights_only: bool | None = None) -> dict:
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
        self.saved_at_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.fast_dev_run or self.saved_at_step == trainer.global_step:
            return
        for callback in trainer.checkpoint_callbacks:
            if getattr(callback, "save_last", None) is True and getattr(callback, "last_model_path", ""):
                trainer.save_checkpoint(callback.last_model_path)


class StopAtTheLastValidation(L.Callback):
    """A fit under ``max_time`` stops at a validation that leaves less time than it took, when that is also under
    ``tail`` of the budget.

    Lightning's Timer stops a fit at the first batch past ``max_time``, and Lightning validates at such a stop.
    So when a validation (an epoch's end, say) ends just short of ``max_time``, the fit trained a few more
    steps and then validated again, ending past ``max_time`` by a whole validation, for weights a few steps
    on (the Fashion scenes captioner on the stand-in for the slower machine: steps 1,249 and 1,250 validated
    ~21 s apart, the fit ending ~40 s past its 9.5 minutes). Stopping at the first of the two gives up less
    training than one validation's time, and only in the budget's last ``tail`` (5%), where a cosine that
    follows ``max_time`` has its rate under 1% of the peak. A validation that is a large part of a short budget
    does not stop the fit early, and one that ends past ``max_time`` is left to Lightning (one more step, the
    Timer's stop, a validation): a phase that the budget's clock starts, such as the captioner's self-critical
    training, then still gets its step on a loaded machine."""

    def __init__(self, tail: float = 0.05) -> None:
        self.tail = tail
        self._started: float | None = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = time.monotonic()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self._started is None or trainer.state.fn != "fit":
            return
        took, self._started = time.monotonic() - self._started, None
        timer = budget_timer(trainer)
        if timer is None:  # no max_time (the same on every rank)
            return
        remaining = timer.time_remaining("train")
        budget = remaining + timer.time_elapsed("train")
        stop = 0 < remaining < min(took, self.tail * budget)  # past max_time, Lightning's own stop is next
        trainer.should_stop = trainer.should_stop or trainer.strategy.broadcast(stop)  # every rank as rank 0


def model_kind(class_path: str) -> str | None:
    """The checkpoint kind of the task a config's ``model.class_path`` names (None if it is not ours)."""
    module_name, _, class_name = class_path.rpartition(".")
    try:
        return getattr(getattr(importlib.import_module(module_name), class_name), "kind", None)
    except (ImportError, AttributeError, ValueError):
        return None  # LightningCLI reports a class it cannot import in its own words


def checkpoint_folder(trainer: L.Trainer, callback: Any) -> Path:
    """Where a ModelCheckpoint will write, as Lightning resolves it: its ``dirpath``, else the first logger's
    ``log_dir/checkpoints`` (a versioned logger picks a new version), else ``default_root_dir/checkpoints``."""
    if getattr(callback, "dirpath", None):
        return Path(callback.dirpath)
    if trainer.loggers and getattr(trainer.loggers[0], "log_dir", None):
        return Path(trainer.loggers[0].log_dir) / "checkpoints"
    return Path(trainer.default_root_dir) / "checkpoints"


class VisionAttnCLI(LightningCLI):
    """LightningCLI with the links of ``LINKED_FROM_DATA`` and a ``--ckpt_path`` check."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        for source, target in LINKED_FROM_DATA.items():
            parser.link_arguments(f"data.{source}", f"model.init_args.{target}", apply_on="instantiate")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="fit: start anew over the checkpoints of an earlier run in the same folder, "
                                 "replacing them (without it, such a fit is refused)")

    def before_fit(self) -> None:
        """Refuse a fresh fit whose checkpoint folder holds an earlier run's checkpoints: replacing them silently
        loses that run. Resuming (``--ckpt_path``) and ``--overwrite true`` go ahead."""
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
        meets another model)."""
        super().parse_arguments(parser, args)
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and ckpt_path not in NAMED_CHECKPOINTS:
            local = str(local_path(ckpt_path))  # a remote path is refused here, before Lightning would fetch it
            self.config[subcommand]["ckpt_path"] = local
            found = load_file(local).get(KIND_KEY)
            model = self.config[subcommand].get("model") or {}
            class_path = model.get("class_path", "") if isinstance(model, dict) else getattr(model, "class_path", "")
            wanted = model_kind(str(class_path))
            if wanted:
                require_kind(found, wanted, source=ckpt_path, training=True)

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
        if budget_timer(trainer) is not None:
            trainer.callbacks.append(StopAtTheLastValidation())
        warning = bf16_warning(trainer.precision, isinstance(trainer.accelerator, CPUAccelerator), cpu_flags())
        if warning:
            rank_zero_warn(warning)
        return trainer


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


def cache_features(args: Sequence[str]) -> None:
    """``vision-attn cache-features --config C [overrides]``: fill the feature cache of every split ahead of
    ``fit``, as ``fit`` would (the model's ``feature_cache`` folder, its frozen encoder part), printing the disk
    size first and a progress bar per split. One process; ``fit`` under DDP fills in parallel instead."""
    cli = VisionAttnCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                        subclass_mode_data=True, args=list(args), run=False, auto_configure_optimizers=False,
                        save_config_callback=None)
    model, datamodule = cli.model, cli.datamodule
    root = getattr(model, "hparams", {}).get("feature_cache")
    if not root:
        raise ValueError("cache-features: the config sets no model.init_args.feature_cache folder (and a "
                         "frozen encoder, trainable_stages); nothing to cache")
    from vision_attn.captioning.module import feature_caches, fill_feature_caches

    caches = feature_caches(model.model, datamodule, ("train", "val", "test"), root,
                            shard_size=model.hparams.get("feature_cache_shard_size", 256))
    total = sum(cache.total_bytes for cache in caches.values())
    first = next(iter(caches.values()))
    print(f"feature cache: {sum(c.count for c in caches.values())} images x {first.bytes_per_image / 1000:.1f} KB = "
          f"{total / 1e6:.1f} MB under {root} ({sum(len(c.missing()) for c in caches.values())} of "
          f"{sum(c.num_shards for c in caches.values())} shards to fill)", flush=True)
    device = cli.trainer.strategy.root_device
    model.to(device)
    fill_feature_caches(model.model, datamodule, caches, device=device)
    for role, cache in caches.items():
        print(f"{role}: {cache.count} images in {cache.folder}")
