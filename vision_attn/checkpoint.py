"""Loading weights and checkpoints without ever executing what is loaded.

Every load in the project goes through here: ``torch.load(weights_only=True)`` for .pt/.pth/.ckpt files,
safetensors for .safetensors. A file whose pickle asks for anything beyond tensors and plain types is
refused with a one-line message.
"""

from __future__ import annotations

import inspect
import os
import pickle
import re
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
from vision_attn.errors import CheckpointError
from vision_attn.io import input_file


def local_path(location: str | os.PathLike) -> Path:
    """A checkpoint or weights location as a local file path. ``file://`` URIs become paths; every other scheme
    (http, https, s3, hf, any fsspec protocol or chain such as ``simplecache::``) is refused, because a file
    fetched from elsewhere is exactly what could carry code, and Lightning unpickles URLs in full."""
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
    """Read a checkpoint or weights file into plain Python (dicts, lists, tensors), never running code."""
    path = input_file(local_path(path), "a checkpoint file", error=CheckpointError)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load_safetensors

        try:
            return load_safetensors(str(path), device=map_location if isinstance(map_location, str) else "cpu")
        except SafetensorError as error:
            raise CheckpointError(f"{path}: not a valid safetensors file ({error})") from None
    with open(path, "rb") as file:
        magic = file.read(4)
    if magic[:2] != b"PK" and magic[:1] != b"\x80":  # torch.save writes a zip; the legacy format a pickle
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint (neither a zip archive nor a pickle)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # protocol notices; the outcome is what matters
            loaded = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"WeightsUnpickler error: ([^\n]*)", str(error))
        reason = (found.group(1).split(". Please")[0].strip() if found else "") or "unsupported content"
        raise CheckpointError(
            f"{path}: refused, the file holds objects other than tensors and plain types ({reason}); "
            "only weights-only checkpoints are loaded"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as error:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({str(error).splitlines()[0]})") from None
    if not isinstance(loaded, Mapping):
        raise CheckpointError(f"{path}: expected a dict of weights, found {type(loaded).__name__}")
    return dict(loaded)


def extract_state_dict(loaded: Mapping[str, Any]) -> dict[str, Tensor]:
    """The model weights inside a raw state dict, a Lightning checkpoint or a ``{"model": ...}`` wrapper.

    Lightning prefixes keys with the attribute that holds the network (``model.``); that prefix is removed.
    """
    for key in ("state_dict", "model", "model_state_dict", "module"):
        inner = loaded.get(key)
        if isinstance(inner, Mapping):
            loaded = inner
            break
    state = {k: v for k, v in loaded.items() if isinstance(v, Tensor)}
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

# Options that say where a model's first weights come from; a checkpoint's own weights replace them
INITIAL_WEIGHT_OPTIONS = ("pretrained", "pretrained_encoder", "object_heads_from_encoder")


def require_kind(found: str | None, wanted: str, *, source: str | os.PathLike = "", training: bool = False) -> None:
    """Refuse a checkpoint written by the other model family (one that does not say passes). ``training``:
    the refusal says the config trains ``wanted``, else that ``wanted`` is needed."""
    if found is None or found == wanted:
        return
    prefix = f"{source}: " if str(source) else ""
    need = f"the config trains a {KIND_NAMES[wanted]}" if training else f"a {KIND_NAMES[wanted]} is needed"
    raise CheckpointError(f"{prefix}this is a {KIND_NAMES.get(found, found)} checkpoint, but {need}")


def checkpoint_kind(loaded: Mapping[str, Any]) -> str | None:
    """The model family (``VIT`` or ``CAPTIONER``) a loaded checkpoint was written by, if it says."""
    return loaded.get(KIND_KEY)


def stamp(checkpoint: dict[str, Any], kind: str) -> None:
    """Mark a checkpoint being saved with its model family and the package version."""
    checkpoint[KIND_KEY] = kind
    checkpoint[VERSION_KEY] = __version__


def upgrade(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Bring a checkpoint written by an earlier vision-attn to today's names, in place: captioner weights under
    ``model.`` (they were at the top level before the LightningModule held a ``Captioner``), and the decoder's
    ``attention`` argument as ``attention_mode``."""
    if checkpoint.get(KIND_KEY) != CAPTIONER:
        return checkpoint
    state = checkpoint.get("state_dict")
    if isinstance(state, dict) and any(key.startswith(("encoder.", "decoder.")) for key in state):
        checkpoint["state_dict"] = {f"model.{key}" if key.startswith(("encoder.", "decoder.")) else key: value
                                    for key, value in state.items()}
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, dict) and "attention" in hparams:
        hparams["attention_mode"] = hparams.pop("attention")
    return checkpoint


class SavedModel(NamedTuple):
    """What inference needs of a training checkpoint: the model's hyper-parameters and its weights."""

    hparams: dict[str, Any]
    state_dict: dict[str, Tensor]


def read_model_checkpoint(path: str | os.PathLike, *, kind: str,
                          loaded: Mapping[str, Any] | None = None) -> SavedModel:
    """The hyper-parameters and the weights (without the LightningModule's ``model.`` prefix) of a checkpoint
    written by ``vision-attn fit``, refusing one of the other model family by name.

    ``loaded`` is the checkpoint already read with ``load_file``, to avoid reading it twice. Initial-weight
    options (``INITIAL_WEIGHT_OPTIONS``) are dropped: the checkpoint's own weights replace them.
    """
    loaded = upgrade(dict(load_file(path) if loaded is None else loaded))
    require_kind(loaded.get(KIND_KEY), kind, source=path)
    if not isinstance(loaded.get("state_dict"), Mapping) or not isinstance(loaded.get("hyper_parameters"), Mapping):
        raise CheckpointError(f"{path}: not a vision-attn checkpoint (no state_dict and hyper_parameters)")
    hparams = {k: v for k, v in loaded["hyper_parameters"].items()
               if not k.startswith("_") and k not in INITIAL_WEIGHT_OPTIONS}
    state = {k.removeprefix("model."): v for k, v in loaded["state_dict"].items() if k.startswith("model.")}
    return SavedModel(hparams, state)


def constructor_args(cls: type, hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``hparams`` that ``cls``'s constructor takes (a task's hyper-parameters hold more)."""
    accepted = inspect.signature(cls).parameters
    return {key: value for key, value in hparams.items() if key in accepted}


def build_model(cls: type[torch.nn.Module], checkpoint: SavedModel, *, source: str | os.PathLike) -> Any:
    """``cls`` built from the checkpoint's hyper-parameters that its constructor takes, with its weights."""
    try:
        model = cls(**constructor_args(cls, checkpoint.hparams))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{source}: its hyper-parameters do not fit {cls.__name__} ({error})") from None
    try:
        model.load_state_dict(checkpoint.state_dict)
    except RuntimeError as error:
        raise CheckpointError(f"{source}: weights do not fit {cls.__name__} ({str(error).splitlines()[0]})") from None
    return model


def capture_rng_state() -> dict[str, Any]:
    """The global random streams (torch CPU, CUDA if present, Python), as weights-only-loadable types."""
    import random

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any] | None) -> None:
    """Put back what ``capture_rng_state`` saved, so augmentation and dropout continue the same sequence."""
    import random

    if not state:
        return
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
