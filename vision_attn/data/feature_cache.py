"""A disk cache of what a frozen encoder makes of each image, so that later epochs read it instead of decoding the
image and running the encoder again (``docs/guides/coco.md``, "The feature cache"): the paper keeps its encoder
fixed (Xu et al. 2015 §4.3). Under ``root/<key digest>/``: ``key.json`` (everything the features depend on; one
that does not match its folder's name makes the shards stale) and fp16 ``shard_NNNNN.npy`` with its
``shard_NNNNN.valid.npy`` flags, each written whole under a temporary name (flags first), so a killed fill resumes
at the first missing shard. Under DDP rank r fills the shards i with i % world_size == r. A shard with another
header, shape or dtype is missing; one holding non-finite values is refused when first read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

FORMAT = 1
DTYPE = np.float16
FP16_MAX = float(np.finfo(np.float16).max)  # 65504


def _tensors_digest(tensors: Iterable[tuple[str, Tensor]]) -> str:
    # SHA-256 of named tensors (names, shapes, dtypes and bytes)
    digest = hashlib.sha256()
    for name, tensor in tensors:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _images_digest(paths: Sequence[Path]) -> str:
    # SHA-256 of the image files' paths, sizes and modification times, in order
    digest = hashlib.sha256()
    for path in paths:
        try:
            stat = Path(path).stat()
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{path}\0missing\n".encode())
    return digest.hexdigest()


class FeatureCache:
    """The cached features (``shape`` per image, fp16) of ``count`` images, identified by ``key``."""

    def __init__(self, root: str | os.PathLike, key: dict[str, Any], count: int, shape: Sequence[int], *,
                 shard_size: int = 256) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        self.key = {"format": FORMAT, "dtype": np.dtype(DTYPE).name, "count": count, "shape": list(shape),
                    "shard_size": shard_size, **key}
        self.key_text = json.dumps(self.key, sort_keys=True, indent=1)  # what ``key.json`` holds
        self.folder = Path(root) / hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:20]
        self.count, self.shape, self.shard_size = count, tuple(shape), shard_size
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def num_shards(self) -> int:
        """How many shards the ``count`` images take."""
        return -(-self.count // self.shard_size)

    def shard_rows(self, shard: int) -> range:
        """The image indices shard ``shard`` holds."""
        return range(shard * self.shard_size, min(self.count, (shard + 1) * self.shard_size))

    def _paths(self, shard: int) -> tuple[Path, Path]:
        return self.folder / f"shard_{shard:05d}.npy", self.folder / f"shard_{shard:05d}.valid.npy"

    @property
    def bytes_per_image(self) -> int:
        """What one image takes on disk: its features and its valid flag."""
        return int(np.prod(self.shape)) * np.dtype(DTYPE).itemsize + 1

    @property
    def total_bytes(self) -> int:
        """What the whole cache takes on disk, in bytes."""
        return self.bytes_per_image * self.count

    @property
    def key_matches(self) -> bool:
        """Whether the folder's ``key.json`` is the one its name stands for (not edited, damaged or deleted)."""
        try:
            return (self.folder / "key.json").read_bytes() == self.key_text.encode()
        except OSError:
            return False

    def _shard_whole(self, shard: int) -> bool:  # its files in place, each with the expected header and size
        features, valid = self._paths(shard)
        if not (features.is_file() and valid.is_file()):
            return False
        rows = len(self.shard_rows(shard))
        try:  # memory-mapped: a header that promises more than the file holds is refused, never allocated
            stored, flags = np.load(features, mmap_mode="r"), np.load(valid, mmap_mode="r")
        except (OSError, ValueError, EOFError):
            return False
        return (stored.shape == (rows, *self.shape) and stored.dtype == DTYPE and flags.shape == (rows,)
                and flags.dtype == np.bool_)

    def missing(self, rank: int = 0, world_size: int = 1) -> list[int]:
        """The shards rank ``rank`` of ``world_size`` has to fill (all of them when ``key.json`` does not match)."""
        shards = range(rank, self.num_shards, world_size)
        if not self.key_matches:
            return list(shards)
        return [shard for shard in shards if not self._shard_whole(shard)]

    @property
    def complete(self) -> bool:
        """Whether every shard is in place."""
        return not self.missing()

    def prepare(self) -> None:
        """Create the folder and its ``key.json``, deleting (and saying so) the shards of one that does not match."""
        self.folder.mkdir(parents=True, exist_ok=True)
        key_file = self.folder / "key.json"
        if self.key_matches:
            return
        if key_file.exists() and not key_file.is_file():
            raise ValueError(f"{key_file}: not a file; delete it, and the next fill writes the cache's key there")
        stale = sorted(self.folder.glob("shard_*"))
        if stale:
            why = "does not match the settings this folder's name stands for" if key_file.exists() else "is missing"
            log.warning("%s %s (edited, damaged or deleted): the %d shard files beside it are stale and are filled "
                        "again", key_file, why, len(stale))
        for path in stale:
            path.unlink()
        _write_atomically(key_file, lambda handle: handle.write(self.key_text.encode()))

    def fill(self, load: Callable[[int], Tensor | None], encode: Callable[[Tensor], Tensor], *, batch_size: int,
             rank: int = 0, world_size: int = 1, progress: Callable[[int], None] | None = None) -> int:
        """Fill this rank's missing shards: ``load(i)`` gives image i (None if unreadable), ``encode`` a batch of them
        -> features (B, *shape), ``progress(n)`` is told of n more done. Returns the number of images encoded."""
        self.prepare()
        done = 0
        for shard in self.missing(rank, world_size):
            rows = self.shard_rows(shard)
            features = np.zeros((len(rows), *self.shape), dtype=DTYPE)
            valid = np.zeros(len(rows), dtype=bool)
            for start in range(0, len(rows), batch_size):
                indices = list(range(start, min(len(rows), start + batch_size)))
                readable = [(i, image) for i in indices if (image := load(rows[i])) is not None]
                if readable:
                    encoded = encode(torch.stack([image for _, image in readable])).float().cpu()
                    largest = float(encoded.abs().max()) if encoded.numel() else 0.0
                    if not largest <= FP16_MAX:  # also NaN
                        raise ValueError(f"the encoder's output reaches {largest:.3g} on image {rows[indices[0]]}.., "
                                         f"beyond fp16's range (±{FP16_MAX:.0f}) that the feature cache stores; "
                                         "are these the encoder's trained weights? (train without feature_cache "
                                         "to keep fp32)")
                    for (i, _), vector in zip(readable, encoded.numpy(), strict=True):
                        features[i], valid[i] = vector, True
                if progress is not None:
                    progress(len(indices))
                done += len(indices)
            features_path, valid_path = self._paths(shard)
            _write_atomically(valid_path, lambda handle, valid=valid: np.save(handle, valid))
            _write_atomically(features_path, lambda handle, features=features: np.save(handle, features))
        return done

    def __getitem__(self, index: int) -> Tensor | None:
        """Image ``index``'s features as an fp16 tensor, or None for an image that could not be read."""
        if not 0 <= index < self.count:
            raise IndexError(f"image {index} of a cache of {self.count}")
        shard, row = divmod(index, self.shard_size)
        if shard not in self._open:
            features_path, valid_path = self._paths(shard)
            if not self._shard_whole(shard):  # changed since the fill checked it
                raise ValueError(f"{features_path}: it or {valid_path.name} beside it is missing or damaged (not the "
                                 "header a fill writes); delete both and the next fit or cache-features fills them "
                                 "again")
            features = np.load(features_path, mmap_mode="r")
            if not np.isfinite(features.sum(dtype=np.float32)):  # once per shard: one pass, no copy
                raise ValueError(f"{features_path}: holds non-finite values (NaN or infinity), which a fill never "
                                 "writes: the shard was damaged after it was written; delete it and the next fit "
                                 "or cache-features fills it again")
            self._open[shard] = (features, np.load(valid_path))
        features, valid = self._open[shard]
        return torch.from_numpy(np.array(features[row])) if valid[row] else None

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own memory maps
        return {**self.__dict__, "_open": {}}


def _write_atomically(path: Path, write: Callable[[Any], Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class FrozenPart(NamedTuple):
    """What a model lends the feature cache: its encoder's frozen part, and what names it besides its weights."""

    module: nn.Module
    description: dict[str, Any]


def split_caches(part: FrozenPart, paths: Mapping[str, Sequence[Path]], root: str | os.PathLike, *,
                 image_size: int, mean: Sequence[float], std: Sequence[float],
                 shard_size: int = 256) -> dict[str, FeatureCache]:
    """Each split's feature cache (``paths`` by role) under ``part``, keyed by everything its features depend on."""
    module = part.module.eval()  # frozen: in eval mode (BatchNorm keeps its statistics)
    device = next(module.parameters()).device
    with torch.no_grad():
        shape = tuple(module(torch.zeros(1, 3, image_size, image_size, device=device)).shape[1:])
    key = {**part.description, "weights": _tensors_digest(sorted(module.state_dict().items())),
           "image_size": image_size, "resize": "squashed to the square, bicubic", "mean": list(mean),
           "std": list(std), "pooled_to": list(shape[-2:])}
    return {role: FeatureCache(root, {**key, "images": _images_digest(split)}, len(split), shape,
                               shard_size=shard_size) for role, split in paths.items()}


def fill_caches(part: FrozenPart, caches: Mapping[str, FeatureCache], *,
                load: Callable[[str, int], Tensor | None], normalize: Callable[[Tensor], Tensor], batch_size: int,
                rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu",
                barrier: Callable[[], None] | None = None, progress: bool = True) -> None:
    """Fill this rank's share of each of ``caches`` on ``device`` (``load(role, index)`` reads an image or None);
    every cache is complete on return (``barrier`` waits for the other ranks)."""
    from tqdm.auto import tqdm
    module = part.module  # frozen: it stays in eval mode (BatchNorm keeps its statistics)
    home = next(module.parameters()).device
    module.to(device).eval()
    for role, cache in caches.items():
        todo = cache.missing(rank, world_size)
        if todo and progress:
            log.info("feature cache of the %s split (%d images, %.1f MB in all, %d KB per image): %s", role,
                     cache.count, cache.total_bytes / 1e6, cache.bytes_per_image // 1000, cache.folder)
        with tqdm(total=sum(len(cache.shard_rows(shard)) for shard in todo), desc=f"caching {role} features",
                  disable=not (todo and progress), unit="img") as bar, torch.no_grad():
            encoded = cache.fill(lambda index, role=role: load(role, index),
                                 lambda images: module(normalize(images.to(device))), batch_size=batch_size,
                                 rank=rank, world_size=world_size, progress=bar.update)
        if todo:
            log.info("rank %d of %d filled %d shards (%d images) of the %s feature cache", rank, world_size,
                     len(todo), encoded, role)
        if barrier is not None:
            barrier()  # every rank's shards are in place
        if not cache.complete:
            raise RuntimeError(f"{cache.folder}: shards {cache.missing()[:5]} are still missing after the fill")
    module.to(home)
