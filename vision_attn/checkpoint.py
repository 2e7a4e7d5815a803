"""Loading weights and checkpoints without ever executing what is loaded.

Every load in the project goes through here: ``torch.load(weights_only=True)`` for .pt/.pth/.ckpt files,
safetensors for .safetensors. A file whose pickle asks for anything beyond tensors and plain types is
refused with a one-line message.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message says which and why."""


def load_file(path: str | os.PathLike, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint or weights file into plain Python (dicts, lists, tensors), never running code."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file as load_safetensors

        try:
            return load_safetensors(str(path), device=str(map_location))
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


KIND_KEY = "vision_attn_kind"
KIND_NAMES = {"vit": "ViT classifier", "captioner": "Show-Attend-Tell captioner"}


def require_kind(found: str | None, wanted: str, *, source: str | os.PathLike = "", training: bool = False) -> None:
    """Refuse a checkpoint written by the other model family (one that does not say passes). ``training``:
    the refusal says the config trains ``wanted``, else that ``wanted`` is needed."""
    if found is None or found == wanted:
        return
    prefix = f"{source}: " if str(source) else ""
    need = f"the config trains a {KIND_NAMES[wanted]}" if training else f"a {KIND_NAMES[wanted]} is needed"
    raise CheckpointError(f"{prefix}this is a {KIND_NAMES.get(found, found)} checkpoint, but {need}")


def checkpoint_kind(loaded: Mapping[str, Any]) -> str | None:
    """The model family ("vit" or "captioner") a loaded checkpoint was written by, if it says."""
    return loaded.get(KIND_KEY)


def load_module(cls: type[torch.nn.Module], path: str | os.PathLike, *, kind: str,
                loaded: Mapping[str, Any] | None = None) -> Any:
    """Rebuild a LightningModule from a checkpoint's plain hyper-parameters and weights.

    ``kind`` is the model family the caller needs; a checkpoint of the other family is refused by name.
    ``loaded`` is the checkpoint already read with ``load_file``, to avoid reading it twice.
    """
    loaded = load_file(path) if loaded is None else loaded
    require_kind(loaded.get(KIND_KEY), kind, source=path)
    if "state_dict" not in loaded or "hyper_parameters" not in loaded:
        raise CheckpointError(f"{path}: not a vision-attn checkpoint (no state_dict and hyper_parameters)")
    hparams = {k: v for k, v in loaded["hyper_parameters"].items() if not k.startswith("_")}
    hparams.pop("pretrained", None)  # the checkpoint's own weights replace any initial weights
    try:
        module = cls(**hparams)
    except TypeError as error:
        raise CheckpointError(f"{path}: its hyper-parameters do not fit {cls.__name__} ({error})") from None
    try:
        module.load_state_dict(loaded["state_dict"])
    except RuntimeError as error:
        raise CheckpointError(f"{path}: weights do not fit {cls.__name__} ({str(error).splitlines()[0]})") from None
    return module


RNG_KEY = "vision_attn_rng"


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
