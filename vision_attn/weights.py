"""Pretrained weights by name, where torchvision and timm keep them: torchvision backbones' ``imagenet`` (their
``DEFAULT``) or enum members (``IMAGENET1K_V1``) in torch.hub's cache; timm's ``imagenet`` (its default) or a
pretrained tag (``a1_in1k``) in the Hugging Face cache; anything else is a local file. A cached file loads without
the network, ``HF_HUB_OFFLINE=1`` forbids downloads, and a missing file or a dead network is a one-line error naming
the file and where to get it (after one request). Every load is weights-only."""

from __future__ import annotations

import functools
import os
import pickle
import re
import socket
import urllib.error
import urllib.parse
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor, nn

from vision_attn.checkpoint import (
    extract_state_dict,
    load_file,
    state_dict_mismatch,
    torch_file_problem,
    unreadable_reason,
)
from vision_attn.errors import CheckpointError

IMAGENET = "imagenet"
TORCHVISION_BACKBONES = ("vgg19", "resnet50", "resnet101")
NETWORK_TIMEOUT = 10.0  # seconds a connection or a read may stall before a download counts as failed
HUB_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm asks the Hub for, in its order
_FILE_SUFFIXES = {".pth", ".pt", ".ckpt", ".bin", ".safetensors", ".tar", ".pkl", ".npz", ".h5"}


class NamedWeights(NamedTuple):
    """Weights a library resolved from a name: the tensors, what they are (for messages), and their normalisation."""

    state_dict: dict[str, Tensor]
    source: str
    mean: list[float]
    std: list[float]


def is_weights_name(value: str | os.PathLike | None) -> bool:
    """True for a weights name (``imagenet``, ``IMAGENET1K_V2``, ``a1_in1k``), False for a local file."""
    if value is None or isinstance(value, os.PathLike):
        return False
    text = str(value)
    return (re.fullmatch(r"[A-Za-z][\w.\-]*", text) is not None
            and Path(text).suffix.lower() not in _FILE_SUFFIXES and not Path(text).exists())


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to 1/true/yes/on, read now."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def no_named_weights(backbone: str, name: str) -> CheckpointError:
    """The error for a weights name given to a backbone without any (the small CNN)."""
    return CheckpointError(f"the {backbone} backbone has no named weights such as '{name}': pass a local file "
                           "(e.g. an encoder pretrained with configs/captioner/fashion_scene_items.yaml)")


def torchvision_weights(backbone: str, name: str) -> NamedWeights:
    """``backbone``'s torchvision weights called ``name``."""
    import torchvision
    enum = torchvision.models.get_model_weights(backbone)
    members = [member for member in enum.__members__ if member != "DEFAULT"]
    wanted = "DEFAULT" if name.lower() == IMAGENET else name.removeprefix(f"{enum.__name__}.").upper()
    if wanted not in enum.__members__:  # the members and their alias DEFAULT
        raise CheckpointError(f"unknown weights '{name}' for {backbone}: use {IMAGENET} (= {enum.DEFAULT.name}), "
                              f"{', '.join(members)}, or a local weights file")
    weights = enum[wanted]
    what = f"torchvision {enum.__name__}.{weights.name}"
    with torch_hub_download(weights.url, what) as cached, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the unpickler's protocol notices: the outcome is what matters
        state = weights.get_state_dict(progress=True, check_hash=True, weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{cached}: not {what}, the file holds a {type(state).__name__}, not a dict of "
                              f"weights; delete it and put the file from {weights.url} there")
    transform = weights.transforms()
    return NamedWeights(state, f"{cached} ({what})", list(transform.mean), list(transform.std))


def torch_hub_file(url: str) -> Path:
    """Where torch.hub keeps the file of ``url``: ``<torch.hub.get_dir()>/checkpoints/<its file name>``."""
    import torch.hub
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urllib.parse.urlparse(url).path)


@contextmanager
def torch_hub_download(url: str, what: str) -> Iterator[Path]:
    """Around a torch.hub load of ``url``, yielding the cache path: a missing file with downloads off, a stalled
    (``NETWORK_TIMEOUT``) or failed download, a damaged file are each one line."""
    cached = torch_hub_file(url)
    fetch = f"on a machine with network download {url} and put it there, or pass the file as a local path"
    if cached.exists():
        problem = torch_file_problem(cached) if cached.is_file() else "not a file"
        if problem:
            raise CheckpointError(f"{cached}: {problem}; delete it and put the file from {url} there")
        try:
            yield cached
        except UNREADABLE as error:
            raise CheckpointError(f"{cached}: {_unreadable(error, what, cached)}; delete it and put the file from "
                                  f"{url} there") from None
        return
    if offline():
        raise CheckpointError(f"{what} is not in torch.hub's cache: no file {cached}, and HF_HUB_OFFLINE is set; "
                              f"{fetch}")
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(NETWORK_TIMEOUT)  # torch.hub's urlopen has no timeout of its own
    try:
        yield cached
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise CheckpointError(f"{what}: no file {cached}, and downloading it failed ({_first_line(error)}); "
                              f"{fetch}") from None
    except RuntimeError as error:
        if cached.exists():
            raise  # the download was kept: torch.hub keeps no file whose hash is not the one its name says
        raise CheckpointError(f"{what}: the download from {url} is damaged ({_first_line(error)}); "
                              f"{fetch}") from None
    finally:
        socket.setdefaulttimeout(previous)


def timm_pretrained_name(model_name: str, name: str = IMAGENET) -> str:
    """``<architecture>.<tag>`` of the timm weights ``name`` (``imagenet``: the model's tag or timm's default)."""
    import timm
    architecture, _, tag = model_name.partition(".")
    if not timm.is_model(architecture):
        raise CheckpointError(f"timm has no model '{architecture}'")
    tags = [found.partition(".")[2] for found in timm.list_pretrained(f"{architecture}.*")]
    if not tags:
        raise CheckpointError(f"timm has no pretrained weights for {architecture}; pass a local weights file")
    default = timm.models.get_pretrained_cfg(architecture).tag
    wanted = (tag or default) if name.lower() == IMAGENET else name
    if wanted not in tags:
        raise CheckpointError(f"unknown weights '{wanted}' for timm:{architecture}: its pretrained tags are "
                              f"{', '.join(tags)} ({IMAGENET} or no tag: timm's default, {default}); or pass a local "
                              "weights file")
    if tag and wanted != tag:
        raise CheckpointError(f"timm:{model_name} names the weights {tag}, but '{name}' was asked for: use "
                              f"{IMAGENET}, or name the weights once")
    return f"{architecture}.{wanted}"


def create_timm_model(pretrained_name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model(pretrained_name, pretrained=True, **kwargs)``; a missing file is one line, fast."""
    import timm
    pretrained_cfg = timm.models.get_pretrained_cfg(pretrained_name)
    what = f"timm {pretrained_name}"
    if pretrained_cfg.hf_hub_id:
        return _create(pretrained_name, what, _check_hub_files(pretrained_cfg.hf_hub_id, what), **kwargs)
    with torch_hub_download(pretrained_cfg.url, what) as cached:
        return _create(pretrained_name, what, cached if cached.exists() else None, **kwargs)


def timm_weights(pretrained_name: str) -> NamedWeights:
    """The timm weights ``<architecture>.<tag>``, as timm loads them."""
    model = create_timm_model(pretrained_name)
    config = model.pretrained_cfg
    return NamedWeights(model.state_dict(), f"timm {pretrained_name}", list(config["mean"]), list(config["std"]))


def _create(pretrained_name: str, what: str, cached: Path | None = None, **kwargs: Any) -> nn.Module:
    # timm's model with its weights; a cached file that cannot be read, or of another architecture, is refused
    import timm
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError
    from safetensors import SafetensorError
    try:
        return timm.create_model(pretrained_name, pretrained=True, **kwargs)
    except (EntryNotFoundError, HfHubHTTPError) as error:
        raise CheckpointError(f"{what}: the Hugging Face Hub did not give its weights ({_first_line(error)})") \
            from None
    except (SafetensorError, *UNREADABLE) as error:
        if cached is None:
            if not isinstance(error, RuntimeError):
                raise  # a failed download: torch_hub_download and huggingface_hub say so
            raise CheckpointError(f"{what}: timm could not build it with its weights ({_first_line(error)})") \
                from None
        folder = " (and its snapshot folder)" if "snapshots" in cached.parts else ""
        expected = functools.partial(timm.create_model, pretrained_name, pretrained=False, **kwargs)
        raise CheckpointError(f"{cached}: {_unreadable(error, what, cached, expected)}; delete it{folder} and "
                              "download it again") from None


UNREADABLE = (pickle.UnpicklingError, RuntimeError, EOFError, OSError, KeyError, zipfile.BadZipFile)


def _unreadable(error: BaseException, what: str, cached: Path, expected: Callable[[], nn.Module] | None = None) -> str:
    # why cached failed to load as what: weights that do not fit the model expected() builds (the first differing
    # key), else not a checkpoint, truncated or damaged; never torch's advice to load with weights_only=False
    if type(error).__name__ == "SafetensorError":
        return f"not a readable safetensors file, truncated or damaged ({_first_line(error)})"
    if expected is not None and isinstance(error, RuntimeError):
        try:
            found = extract_state_dict(load_file(cached))
        except CheckpointError:
            found = None
        if found is not None:  # it reads: its weights did not fit
            mismatch = state_dict_mismatch(expected().state_dict(), found)
            return f"not {what}: {mismatch or 'its weights do not load into the model'}"
    if cached.suffix == ".safetensors":
        return f"not a readable safetensors file, truncated or damaged ({type(error).__name__})"
    return unreadable_reason(error, cached)


def _check_hub_files(hub_id: str, what: str) -> Path | None:
    # the cached weights file of hub_id, or None when it is not there but the Hub answers; else one line after one
    # request (huggingface_hub's retries wait long on a dead network)
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name
    repo_id, _, revision = hub_id.partition("@")
    revision = revision or "main"
    for file in HUB_FILES:
        found = try_to_load_from_cache(repo_id, file, revision=revision)
        if isinstance(found, str):
            return Path(found)
    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    looked_for = folder / "snapshots" / f"<commit in refs/{revision}>" / HUB_FILES[0]
    url = hf_hub_url(repo_id, HUB_FILES[0], revision=revision)
    fetch = (f"on a machine with network run `hf download {repo_id} {HUB_FILES[0]}` and copy its {folder.name} "
             f"folder into {folder.parent}, or download {url} and pass the file as a local path")
    if offline() or constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"{what} is not in the Hugging Face cache: no file {looked_for}, and HF_HUB_OFFLINE "
                              f"is set; {fetch}")
    try:
        get_hf_file_metadata(url, timeout=min(NETWORK_TIMEOUT, constants.HF_HUB_ETAG_TIMEOUT))
    except EntryNotFoundError:
        return None  # the Hub answered; timm asks it for its other file names
    except Exception as error:  # whatever stops the request (network, proxy, TLS, access) stops the load
        raise CheckpointError(f"{what}: no file {looked_for}, and the Hugging Face Hub cannot be reached "
                              f"({type(error).__name__}: {_first_line(error)}); {fetch}") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
