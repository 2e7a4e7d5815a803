"""Loading weights and checkpoints without ever executing what is loaded: every load in the project goes through
here, ``torch.load(weights_only=True)`` for .pt/.pth/.ckpt files, safetensors for .safetensors; a file whose pickle
asks for anything beyond tensors and plain types is refused in one line. Also the model kinds, and the upgrades of
checkpoints written by earlier versions."""

from __future__ import annotations

import copy
import os
import pickle
import random
import re
import struct
import urllib.parse
import urllib.request
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vision_attn import __version__
from vision_attn.captioning.upgrades import extension_weight_name, upgrade_extensions
from vision_attn.checkpoint_checks import first_non_finite, inspect_torch_file, metadata_problem, weights_of, zip_damage
from vision_attn.errors import CheckpointError
from vision_attn.io import input_file


def local_path(location: str | os.PathLike) -> Path:
    """A checkpoint or weights location as a local path: ``file://`` URIs become paths; every other scheme or fsspec
    chain (``simplecache::``) is refused, because a file fetched from elsewhere is what could carry code."""
    text = str(location)
    if "://" in text or "::" in text:
        parsed = urllib.parse.urlparse(text)
        if parsed.scheme.lower() != "file" or "::" in text:
            scheme = text.split("::", 1)[0] if "::" in text.split("://", 1)[0] else parsed.scheme
            raise CheckpointError(f"{text}: remote checkpoints ({scheme}) are not loaded, because loading one can run "
                                  "code it carries; download it, check it, and pass the local file")
        return Path(urllib.request.url2pathname(parsed.path))
    return Path(text)


def load_file(path: str | os.PathLike, *, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint or weights file as plain Python (dicts, lists, tensors), never running code, and only when it is
    sound (``checkpoint_checks``); each refusal is one line naming the file."""
    path = input_file(local_path(path), "a checkpoint file", error=CheckpointError)
    loaded = _read(path, map_location)
    if (non_finite := first_non_finite(loaded)) is not None:
        raise CheckpointError(f"{path}: the weight {non_finite} holds NaN or infinite values; a fit that diverged "
                              "wrote it, or the file was altered")
    if problem := metadata_problem(loaded):
        raise CheckpointError(f"{path}: not a vision-attn checkpoint as written, {problem}")
    return loaded


def _read(path: Path, map_location: Any) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load_safetensors
        try:
            return load_safetensors(str(path), device=map_location if isinstance(map_location, str) else "cpu")
        except SafetensorError as error:
            raise CheckpointError(f"{path}: not a valid safetensors file ({error})") from None
    if problem := torch_file_problem(path):
        raise CheckpointError(f"{path}: {problem}")
    if damage := zip_damage(path):
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint, truncated or damaged ({damage})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # protocol notices; the outcome is what matters
            loaded = torch.load(path, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, zipfile.BadZipFile, KeyError, ValueError,
            TypeError, AttributeError, IndexError, struct.error) as error:  # what a damaged file makes torch raise
        raise CheckpointError(f"{path}: {unreadable_reason(error, path)}") from None
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: expected a dict of weights, found {type(loaded).__name__}")
    return dict(loaded)


def torch_file_problem(path: Path) -> str | None:
    """What its first bytes say is wrong with a file for ``torch.load`` (a zip archive, or a legacy pickle)."""
    with open(path, "rb") as file:
        magic = file.read(4)
    if not magic:
        return "not a PyTorch checkpoint, the file is empty"
    if magic[:2] != b"PK" and magic[:1] != b"\x80":
        return "not a readable PyTorch checkpoint (neither a zip archive nor a pickle)"
    return None


def unreadable_reason(error: BaseException, path: Path) -> str:
    """Why ``torch.load(weights_only=True)`` raised ``error`` on ``path``, in our words from what we see of the file
    (``inspect_torch_file``) and the error's type: torch's advice to load with ``weights_only=False`` (which runs
    whatever code the file carries) is never passed on."""
    damage, foreign = inspect_torch_file(path)
    if damage:
        return f"not a readable PyTorch checkpoint, truncated or damaged ({damage})"
    if foreign:
        return (f"refused, the file holds objects other than tensors and plain types ({foreign}); only weights-only "
                "checkpoints are loaded")
    if isinstance(error, pickle.UnpicklingError):  # an operation the weights-only unpickler does not run
        return ("refused, not a weights-only checkpoint: its pickle holds more than tensors and plain types (an "
                "operation the weights-only reader does not run)")
    detail = "the file ends early" if isinstance(error, EOFError) else type(error).__name__
    return f"not a readable PyTorch checkpoint, truncated or damaged ({detail})"


def extract_state_dict(loaded: Mapping[str, Any]) -> dict[str, Tensor]:
    """The tensors of a raw state dict, a Lightning checkpoint or a wrapper (``weights_of``), without Lightning's
    ``model.`` prefix."""
    state = {k: v for k, v in weights_of(loaded).items() if isinstance(v, Tensor)}
    if not state:
        raise CheckpointError("no tensors found in the weights file")
    if all(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items()}
    return state


# What every vision-attn checkpoint says about itself: the model family that wrote it, and the package version.
KIND_KEY = "vision_attn_kind"
VERSION_KEY = "vision_attn_version"
RNG_KEY = "vision_attn_rng"
VIT, CAPTIONER, ENCODER, CONVNET = "vit", "captioner", "encoder", "convnet"
KIND_NAMES = {VIT: "ViT classifier", CAPTIONER: "Show-Attend-Tell captioner",
              ENCODER: "captioner-encoder pretraining", CONVNET: "CNN classifier (a ViT's teacher)"}

def require_kind(found: str | None, wanted: str, *, source: str | os.PathLike = "", training: bool = False) -> None:
    """Refuse a checkpoint of another model family than ``wanted`` (one that does not say passes)."""
    if found is None or found == wanted:
        return
    prefix = f"{source}: " if str(source) else ""
    need = f"the config trains a {KIND_NAMES[wanted]}" if training else f"a {KIND_NAMES[wanted]} is needed"
    # a kind of ours by its name; any other quoted, as a value the file holds (errors.printable escapes what it must)
    raise CheckpointError(f"{prefix}this is a {KIND_NAMES.get(found) or repr(found)} checkpoint, but {need}")


def checkpoint_kind(loaded: Mapping[str, Any]) -> str | None:
    """The model family (``VIT`` or ``CAPTIONER``) a loaded checkpoint was written by, if it says."""
    return loaded.get(KIND_KEY)


def stamp(checkpoint: dict[str, Any], kind: str) -> None:
    """Mark a checkpoint being saved with its model family and the package version."""
    checkpoint[KIND_KEY] = kind
    checkpoint[VERSION_KEY] = __version__


# Where each flat hyper-parameter of a checkpoint written before the option groups (vision-attn 0.1) lives
# today: "group.field", a top-level name, or None (no longer the model's: the feature cache is the DataModule's).
_ENCODER = {"backbone": "encoder.backbone", "encoder_width": "encoder.width", "encoder_stride": "encoder.stride",
            "channels_last": "encoder.channels_last"}
_IMAGE = {"image_size": "image.size", "in_chans": "image.channels", "mean": "image.mean", "std": "image.std"}
_OPTIMISER = {"lr": "optimiser.lr", "weight_decay": "optimiser.weight_decay", "betas": "optimiser.betas",
              "warmup_epochs": "schedule.warmup_epochs", "min_lr_ratio": "schedule.min_lr_ratio",
              "schedule_by_time": "schedule.by_time", "log_overlays": "log_overlays", "num_classes": "num_classes",
              "class_names": "class_names"}
_DECODER = ("embed_dim", "hidden_dim", "attention_dim", "dropout", "attention_mode", "initial_gate", "coverage",
            "attend_with_word", "word_counts", "word_count_context", "attention_score", "attention_heads",
            "hard_expectation_prob")
_VIT = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "global_pool", "pos_embed_init",
        "zero_init_head", "fused_attention", "stem", "reg_tokens", "dist_token", "channels_last")
LEGACY_NAMES: dict[str, dict[str, str | None]] = {
    CAPTIONER: {
        **_IMAGE, **_OPTIMISER, **_ENCODER, "vocabulary": "vocabulary", "grid_size": "encoder.grid_size",
        "pretrained_encoder": "encoder.pretrained", "vit": "encoder.vit",
        "trainable_stages": "encoder.trainable_stages",
        **{name: f"decoder.{name}" for name in _DECODER}, "attention": "decoder.attention_mode",
        "beam_size": "decoding.beam_size", "max_decode_length": "decoding.max_length",
        "length_penalty": "decoding.length_penalty",
        **{name: f"objective.{name}" for name in ("doubly_stochastic_weight", "loss_normalisation", "reinforce_weight",
                                                   "entropy_weight", "baseline_decay")},
        **{name: f"aids.{name}" for name in ("concept_weight", "object_weight", "grounding_weight",
                                              "object_heads_from_encoder")},
        "self_critical_from_epoch": "self_critical.from_epoch",
        "self_critical_from_time": "self_critical.from_progress",
        "self_critical_samples": "self_critical.samples", "repeat_penalty": "self_critical.repeat_penalty",
        "recall_reward": "self_critical.recall_reward", "encoder_lr": "optimiser.encoder_lr",
        "object_classes": "objects.classes", "object_colours": "objects.colours", "feature_cache": None,
        "feature_cache_shard_size": None,
    },
    VIT: {
        **_IMAGE, **_OPTIMISER, **{name: f"architecture.{name}" for name in _VIT},
        **{name: f"training.{name}" for name in ("drop_rate", "attn_drop_rate", "drop_path_rate", "patch_drop_rate",
                                                  "patch_drop_rate_end", "label_smoothing", "attention_grounding")},
        "teacher": "distillation.teacher", "distillation": "distillation.mode",
        "distillation_weight": "distillation.weight", "distillation_tau": "distillation.tau",
        "pretrained": "pretrained", "compile": "compile",
    },
    CONVNET: {**_IMAGE, **_OPTIMISER, "widths": "architecture.widths", "drop_rate": "training.drop_rate",
              "label_smoothing": "training.label_smoothing"},
    ENCODER: {**_IMAGE, **_OPTIMISER, **_ENCODER, "label_smoothing": "label_smoothing", "num_colours": "colour_names"},
}
# The groups each kind's hyper-parameters hold today: a checkpoint with one of them as a mapping is in today's form
CURRENT_GROUPS = {CAPTIONER: "decoder", VIT: "architecture", CONVNET: "architecture", ENCODER: "encoder"}
# The colours of the scenes' items when encoder pretraining checkpoints said only how many they had (num_colours)
LEGACY_COLOURS = ("red", "green", "blue", "yellow", "white")
# The options that say where a fit's first weights come from: a checkpoint's own weights replace them
INITIAL_WEIGHTS = {CAPTIONER: ("encoder.pretrained", "objective.auxiliary.heads_from_encoder"), VIT: ("pretrained",),
                   CONVNET: (), ENCODER: ("encoder.pretrained",)}


def upgrade_hyper_parameters(kind: str, hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Flat 0.1 hyper-parameters in today's groups (``LEGACY_NAMES``); today's as they are, less Lightning's
    ``_class_path`` and ``_instantiator`` (the class may have moved)."""
    hparams = {k: v for k, v in hparams.items() if not k.startswith("_")}
    if kind not in LEGACY_NAMES or isinstance(hparams.get(CURRENT_GROUPS[kind]), Mapping):
        return hparams
    grouped: dict[str, Any] = {"image": {"channels": 3}} if kind == CAPTIONER else {}
    for key, value in hparams.items():
        if key == "num_colours":
            value = list(LEGACY_COLOURS[:value])
        if target := LEGACY_NAMES[kind].get(key):
            group, _, name = target.rpartition(".")
            (grouped.setdefault(group, {}) if group else grouped)[name] = value
    return grouped


def upgrade_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A captioner's weights under today's names (0.1's encoder and decoder at the top, the aids' heads, the
    extensions', REINFORCE's baseline, a ViT trunk's blocks in a wrapper)."""
    renamed = {}
    for key, value in state.items():
        if key.startswith(("encoder.", "decoder.")):
            key = f"model.{key}"
        elif key.startswith(("concept_head.", "object_head.", "object_colour_head.")):
            key = f"aids.{key}"
        elif key == "reward_baseline":
            key = "reinforce.baseline"
        key = re.sub(r"^(model\.encoder\.trunk\.\d+)\.block\.", r"\1.", key)
        renamed[extension_weight_name(key)] = value
    return renamed


def without_initial_weights(kind: str, hparams: Mapping[str, Any]) -> dict[str, Any]:
    """``hparams`` with the initial-weight options (``INITIAL_WEIGHTS``) cleared (``clear_initial_weights``)."""
    cleared = copy.deepcopy(dict(hparams))
    clear_initial_weights(kind, cleared)
    return cleared


def clear_initial_weights(kind: str | None, options: Any) -> None:
    """Set the ``INITIAL_WEIGHTS`` of ``kind`` in ``options`` (anything read by key with ``get``) to None (False for
    a flag), in place; a path through a list of extensions clears each entry's."""
    for target in INITIAL_WEIGHTS.get(kind or "", ()):
        *path, name = target.split(".")
        holders: list[Any] = [options]
        for key in path:
            holders = [item for holder in holders if hasattr(holder, "get") for item in
                       (holder[key] if isinstance(holder.get(key), list) else [holder.get(key)])]
        for holder in holders:
            if hasattr(holder, "get") and name in holder:
                holder[name] = False if isinstance(holder[name], bool) else None


def upgrade(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of an earlier vision-attn in today's form, in place: hyper-parameters in option groups, weights
    under today's names."""
    kind = checkpoint.get(KIND_KEY)
    state = checkpoint.get("state_dict")
    if kind == CAPTIONER and isinstance(state, dict):
        checkpoint["state_dict"] = upgrade_state_dict(state)
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, Mapping) and kind is not None:
        checkpoint["hyper_parameters"] = upgrade_hyper_parameters(kind, hparams)
        if kind == CAPTIONER:
            upgrade_extensions(checkpoint["hyper_parameters"])
    return checkpoint


def hyper_parameters(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """The hyper-parameters of a loaded vision-attn checkpoint, in today's groups ({} when it has none)."""
    hparams = loaded.get("hyper_parameters")
    if not isinstance(hparams, Mapping):
        return {}
    return dict(upgrade({KIND_KEY: loaded.get(KIND_KEY), "hyper_parameters": dict(hparams)})["hyper_parameters"])


class SavedModel(NamedTuple):
    """What inference needs of a training checkpoint: the model's hyper-parameters and its weights."""

    hparams: dict[str, Any]
    state_dict: dict[str, Tensor]


def read_model_checkpoint(path: str | os.PathLike, *, kind: str,
                          loaded: Mapping[str, Any] | None = None) -> SavedModel:
    """The hyper-parameters (today's groups, initial-weight options cleared) and the weights (without ``model.``) of
    a ``vision-attn fit`` checkpoint of ``kind``; ``loaded``: the file already read by ``load_file``."""
    loaded = upgrade(dict(load_file(path) if loaded is None else loaded))
    require_kind(loaded.get(KIND_KEY), kind, source=path)
    if not isinstance(loaded.get("state_dict"), Mapping) or not isinstance(loaded.get("hyper_parameters"), Mapping):
        raise CheckpointError(f"{path}: not a vision-attn checkpoint (no state_dict and hyper_parameters)")
    hparams = without_initial_weights(kind, loaded["hyper_parameters"])
    state = {k.removeprefix("model."): v for k, v in loaded["state_dict"].items() if k.startswith("model.")}
    return SavedModel(hparams, state)


def load_weights(model: torch.nn.Module, state: Mapping[str, Tensor], *, source: str | os.PathLike) -> Any:
    """``model`` with ``state`` loaded strictly, refused in one line naming ``source`` when they do not fit."""
    if problem := state_dict_mismatch(model.state_dict(), state):
        raise CheckpointError(f"{source}: weights do not fit {type(model).__name__}: {problem}")
    model.load_state_dict(state)
    return model


def state_dict_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str | None:
    """Why the weights ``found`` do not fit a model whose ``state_dict()`` is ``expected``, as one clause: the first
    key of another type or shape, else the counts of missing and unexpected keys (None when they fit)."""
    for key, tensor in expected.items():
        value = found.get(key)
        if key in found and not isinstance(value, Tensor):
            return f"weights for another architecture, {key} is a {type(value).__name__} in the file, not a tensor"
        if isinstance(value, Tensor) and value.shape != tensor.shape:
            return (f"weights for another architecture, {key} is ({', '.join(map(str, value.shape))}) in the file "
                    f"but ({', '.join(map(str, tensor.shape))}) in the model")
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    parts = [f"{len(keys)} {label} keys, e.g. {keys[0]}" for label, keys in (("missing", missing),
                                                                             ("unexpected", unexpected)) if keys]
    return f"weights for another architecture ({'; '.join(parts)})" if parts else None


def capture_rng_state() -> dict[str, Any]:
    """The global random streams (torch CPU, CUDA if present, Python), as weights-only-loadable types."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any] | None) -> None:
    """Put back what ``capture_rng_state`` saved, so augmentation and dropout continue the same sequence."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
