"""Typed option groups: every task and DataModule is configured with small frozen dataclasses, each field documented
by the string under it (shown by ``vision-attn fit --help`` and ``docs/configuration.md``). Here: the base class and
the groups several tasks share; the others live next to their models and DataModules.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from dataclasses import fields as group_fields  # ``merged`` takes ``**fields``
from typing import Any, TypeVar

Group = TypeVar("Group", bound="OptionGroup")


def plain(value: Any) -> Any:
    """``value`` with every group (dataclass) as a dict and every tuple as a list: what a checkpoint stores."""
    if is_dataclass(value) and not isinstance(value, type):
        return {key: plain(item) for key, item in asdict(value).items()}
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


@dataclass(frozen=True)
class OptionGroup:
    """What every option group (a ``@dataclass(frozen=True)``) has: ``coerce``, ``check``, and ``name``."""

    name = "options"  # the argument that holds the group, as a message names it

    @classmethod
    def coerce(cls: type[Group], value: Group | Mapping[str, Any] | None, default: Group | None = None) -> Group:
        """The group, checked, from itself, a plain dict (a config's mapping or a checkpoint's hyper-parameters, set
        over ``default``; unknown keys and wrong scalar types refused) or None (``default``, else the group's own)."""
        if value is None:
            group = default if default is not None else cls()
        elif isinstance(value, cls):
            group = value
        elif isinstance(value, Mapping):
            known = {field.name for field in group_fields(cls)}
            if unknown := sorted(set(value) - known):
                raise ValueError(f"{cls.name}: unknown option{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(unknown)}; it takes {', '.join(sorted(known))}")
            texts = {field.name for field in group_fields(cls) if field.type in ("str", "str | None")}
            value = {key: os.fspath(item) if key in texts and isinstance(item, os.PathLike) else item
                     for key, item in value.items()}  # a path given from Python is the text a config would hold
            wrong = next((f"{cls.name}.{field.name} must be {SCALAR_TYPES[field.type][0]}, got "
                          f"{type(value[field.name]).__name__}" for field in group_fields(cls)
                          if field.name in value and not scalar_fits(field.type, value[field.name])), None)
            if wrong:  # a checkpoint's hyper-parameters meet no parser: a type is checked here, naming the option
                raise ValueError(wrong)
            group = cls(**{**(vars(default) if default is not None else {}), **value})
        else:
            raise ValueError(f"{cls.name}: expected a mapping of options, got {type(value).__name__}")
        group.check()
        return group

    @classmethod
    def merged(cls: type[Group], options: Group | Mapping[str, Any] | None = None, **fields: Any) -> Group:
        """``options`` (as ``coerce`` takes it) with ``fields`` set over it, checked: a network takes its group or
        keyword arguments."""
        group = cls.coerce(options)
        return cls.coerce({**vars(group), **fields}) if fields else group

    def check(self) -> None:
        """Refuse, in one line naming the option, a value that is out of range or does not fit the others."""

    def to_dict(self) -> dict[str, Any]:
        """The group as a checkpoint stores it (``plain``)."""
        return plain(self)


# The scalar annotations of groups' fields: how a message says each, and the types a value may have
SCALAR_TYPES: dict[str, tuple[str, tuple[type, ...]]] = {
    "int": ("a whole number", (int,)), "float": ("a number", (int, float)), "bool": ("true or false", (bool,)),
    "str": ("a string", (str,)), "int | None": ("a whole number or null", (int, type(None))),
    "float | None": ("a number or null", (int, float, type(None))),
    "str | None": ("a string or null", (str, type(None))),
}


def scalar_fits(annotation: Any, value: Any) -> bool:
    """Whether ``value`` has a type of the scalar field ``annotation`` (``SCALAR_TYPES``; a bool is no number);
    True for any other annotation, whose group checks it."""
    if annotation not in SCALAR_TYPES:
        return True
    types = SCALAR_TYPES[annotation][1]
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def require(condition: bool, group: str, message: str) -> None:
    """Raise ``ValueError("<group>.<message>")`` unless ``condition``: the one-line refusal every group gives."""
    if not condition:
        raise ValueError(f"{group}.{message}")


def at_most(group: str, key: str, value: Any, high: int, why: str) -> None:
    """Refuse, in one line naming the option, a number above ``high``, saying ``why`` it is bounded."""
    require(not isinstance(value, int | float) or value <= high, group, f"{key} must be at most {high} ({why}), "
                                                                        f"got {value}")


def finite(value: float) -> bool:
    """Whether ``value`` is a number and finite (not NaN or ±inf, nor a string or None)."""
    return isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True)
class ImageFormat(OptionGroup):
    """How an image becomes the network's input: squashed to a ``size`` square of ``channels`` channels, scaled to
    [0, 1], then normalised per channel, (x − mean) / std. The DataModule says it and the CLI links it into the
    model; a checkpoint keeps it, so inference reads images as training did."""

    name = "image"

    size: int = 224
    """side of the square network input, in pixels"""
    channels: int = 3
    """colour channels: 3 (RGB) or 1 (grey)"""
    mean: list[float] | None = None
    """per-channel mean the pixels are normalised with (null: the model's default)"""
    std: list[float] | None = None
    """per-channel standard deviation the pixels are normalised with (null: the model's default)"""

    def check(self) -> None:
        """Refuse a size outside 1..4096, channels other than 1 or 3, a mean or std without a finite value per
        channel, or a std not above 0."""
        require(isinstance(self.size, int) and self.size >= 1, self.name, f"size must be at least 1, got {self.size}")
        at_most(self.name, "size", self.size, 4096, "a larger input only costs memory")
        require(self.channels in (1, 3), self.name, f"channels must be 1 or 3, got {self.channels}")
        for key in ("mean", "std"):
            values = getattr(self, key)
            require(values is None or (isinstance(values, Sequence) and len(values) == self.channels
                                       and all(finite(v) for v in values)), self.name,
                    f"{key} needs {self.channels} finite values (one per channel), got {values}")
        require(self.std is None or all(v > 0 for v in self.std), self.name, f"std must be above 0, got {self.std}")

    def normalisation(self, mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
        """(mean, std), each filled with the given default (one value per channel, e.g. ImageNet's) when unset."""
        return list(self.mean or mean), list(self.std or std)


@dataclass(frozen=True)
class Optimiser(OptionGroup):
    """AdamW (Loshchilov & Hutter 2019): the learning rate, decoupled weight decay and Adam's betas. Weight decay
    falls on matrices only, never on biases, norms, tokens or position embeddings."""

    name = "optimiser"

    lr: float = 1e-3
    """peak learning rate (after warm-up)"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay"""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's β1, β2"""

    def check(self) -> None:
        """Refuse an lr not above 0, a negative weight decay, or betas that are not two numbers in [0, 1)."""
        require(finite(self.lr) and self.lr > 0, self.name, f"lr must be above 0, got {self.lr}")
        require(finite(self.weight_decay) and self.weight_decay >= 0, self.name,
                f"weight_decay must be 0 or more, got {self.weight_decay}")
        require(len(self.betas) == 2 and all(finite(b) and 0 <= b < 1 for b in self.betas), self.name,
                f"betas must be two numbers from 0 to below 1, got {list(self.betas)}")


@dataclass(frozen=True)
class Schedule(OptionGroup):
    """The run's schedule: a linear warm-up of the learning rate, then a cosine to ``min_lr_ratio`` of it at the end
    of training. With ``by_time`` and a ``trainer.max_time``, the end of training is the end of the time budget
    when that comes first (budgeted training, Li et al. 2020), so a run capped by time finishes its schedule
    however fast the machine is; the schedule's other phases (the captioner's self-critical switch, the ViT's
    PatchDropout rate) follow the same progress."""

    name = "schedule"

    warmup_epochs: float = 0.0
    """epochs (a fraction allowed) of linear warm-up"""
    min_lr_ratio: float = 0.0
    """the learning rate at the end, as a share of the peak"""
    by_time: bool = False
    """the progress is the further along of the steps and the trainer's max_time budget"""

    def check(self) -> None:
        """Refuse a negative warm-up or a min_lr_ratio outside [0, 1]."""
        require(finite(self.warmup_epochs) and self.warmup_epochs >= 0, self.name,
                f"warmup_epochs must be 0 or more, got {self.warmup_epochs}")
        require(finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, self.name,
                f"min_lr_ratio must be from 0 to 1, got {self.min_lr_ratio}")


@dataclass(frozen=True)
class Loader(OptionGroup):
    """How a DataModule batches a split: the batch sizes, worker processes, pinned memory, and what an unreadable
    image does."""

    name = "loader"

    batch_size: int = 64
    """training batch size"""
    eval_batch_size: int | None = None
    """validation and test batch size (null: batch_size)"""
    num_workers: int = 0
    """DataLoader worker processes (0: load in the main process)"""
    pin_memory: bool = False
    """page-locked batches, for faster copies to a GPU"""
    on_bad_image: str = "skip"
    """an unreadable image is left out with a warning and counted (skip), or stops the run (error)"""

    def check(self) -> None:
        """Refuse a batch size below 1, a negative worker count, either above its bound, or an unknown
        on_bad_image."""
        require(isinstance(self.batch_size, int) and self.batch_size >= 1, self.name,
                f"batch_size must be at least 1, got {self.batch_size}")
        require(self.eval_batch_size is None or self.eval_batch_size >= 1, self.name,
                f"eval_batch_size must be at least 1, got {self.eval_batch_size}")
        require(isinstance(self.num_workers, int) and self.num_workers >= 0, self.name,
                f"num_workers must be 0 or more, got {self.num_workers}")
        for key, high, why in (("batch_size", 8192, "past the largest batches that train well, it only costs memory"),
                               ("eval_batch_size", 8192, "a larger batch only costs memory"),
                               ("num_workers", 256, "more workers than cores only cost memory")):
            at_most(self.name, key, getattr(self, key), high, why)
        require(self.on_bad_image in ("skip", "error"), self.name,
                f"on_bad_image must be 'skip' or 'error', got {self.on_bad_image!r}")

    @property
    def eval_size(self) -> int:
        """The validation and test batch size: eval_batch_size, or batch_size when unset."""
        return self.eval_batch_size or self.batch_size
