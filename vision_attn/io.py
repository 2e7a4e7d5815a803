"""Result files written atomically, never in place of a device or a pipe; and output folders a command owns
(``OwnedFolder``): it replaces only what it can prove it wrote there."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NamedTuple


def refuse_not_a_file(path: Path) -> None:
    """Raise, in one line, where ``path`` is there and not a regular file (a folder, a device, a pipe)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        problem = "is a folder" if stat.S_ISDIR(mode) else "is not a regular file (a device, a pipe or a socket)"
        raise ValueError(f"{path}: {problem}; give the name of a regular file to write")


def replace_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, then rename it into place (atomic on POSIX); a failure
    leaves ``path`` untouched. A ``path`` that is not a regular file is refused before writing and before the rename."""
    path = Path(path)
    refuse_not_a_file(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        file = tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                           delete=False)
        temporary = Path(file.name)
        try:
            with file:  # closing flushes: a full disk may show only then
                write(file)
            umask = os.umask(0)
            os.umask(umask)
            temporary.chmod(0o666 & ~umask)  # a normal file's permissions, not the temporary file's 0600
            refuse_not_a_file(path)  # it may have become one while the file was written
            temporary.replace(path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    except OSError as error:  # a full disk, a folder that refuses files: one line naming the output, not a traceback
        raise ValueError(f"{path}: cannot be written ({error.strerror or error}); nothing was written there") from None
    return path


def write_json_atomically(path: str | os.PathLike, payload: Any) -> Path:
    """Write JSON to ``path`` atomically."""
    text = json.dumps(payload, allow_nan=False)  # JSON has no NaN or Infinity: refused before anything is written
    return replace_atomically(path, lambda file: file.write(text.encode("utf-8")))


def _check_parents(path: Path) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{path}: cannot be written, {parent} is a file, not a folder")
            return


def output_file(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """A file a command will write, checked before any work: a regular file or nothing, not under a file, and not one
    of ``inputs`` (by a link, a hard link or another spelling of its path)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; give the name of a file to write")
    refuse_not_a_file(path)
    _check_parents(path)
    writable_folder(path.parent)  # a folder the process may not write in (root's too: /proc, /sys, a read-only mount)
    for item in inputs:
        try:
            same = os.path.samefile(path, item)
        except OSError:  # one of them is not there (the output not yet: it is none of the inputs)
            continue
        if same:
            raise ValueError(f"{path}: is one of the inputs ({item}); writing it would overwrite it (choose another "
                             "output)")
    return path


def output_folder(path: str | os.PathLike) -> Path:
    """A folder a command will write into, checked before any work: not an existing file, not under a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: is {'a file' if path.is_file() else 'a device, a pipe or a socket'}, not a folder "
                         "to write into")
    _check_parents(path)
    return path


def input_file(path: str | os.PathLike, what: str, *, error: type[Exception] = ValueError) -> Path:
    """A file a command reads, checked before it is opened: no folder, pipe (it would block) or device."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a folder, not {what}")
    if path.exists() and not path.is_file():
        raise error(f"{path}: not a regular file (a pipe or a device?), so not {what}")
    if not path.is_file():
        raise (FileNotFoundError if error is ValueError else error)(f"{path}: no such file ({what} was expected)")
    return path


MANIFEST = ".vision-attn-manifest.json"  # in a folder a command wrote: the command and the files it wrote there
MAX_MANIFEST_BYTES = 64 * 2**20  # far above what any command lists; a larger one is not ours
STAGING_PREFIX = ".vision-attn-staging-"  # a command writes into such a hidden folder, then moves the files in


def writable_folder(path: str | os.PathLike) -> Path:
    """Refuse, before any work, a folder (or its nearest existing parent) that this process cannot create files in."""
    path = Path(path)
    existing = next((folder for folder in (path, *path.parents) if folder.exists()), Path.cwd())
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".vision-attn-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"{path}: cannot write there ({error.strerror or error}: {existing}); choose a folder "
                         "you can write to") from None
    return path


def file_record(path: Path) -> dict[str, Any]:
    """What the manifest keeps of a file written: its size and SHA-256."""
    with path.open("rb") as file:
        return {"size": os.fstat(file.fileno()).st_size, "sha256": hashlib.file_digest(file, "sha256").hexdigest()}


def inside(folder: Path, name: object) -> Path | None:
    """``folder / name`` where it is safe to write or remove (a relative path without ``..``, no link on the way or
    at the end, resolving inside ``folder``); else None."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(name).is_absolute() or ".." in parts or Path(name) == Path(MANIFEST):
        return None
    step = folder
    for part in parts:
        step = step / part
        try:
            mode = os.lstat(step).st_mode
        except OSError:
            break  # not there yet: nothing below it is either
        if stat.S_ISLNK(mode) or (step != folder / name and not stat.S_ISDIR(mode)):
            return None
    real = os.path.realpath(folder)
    return folder / name if os.path.realpath(folder / name).startswith(real + os.sep) else None


class Manifest(NamedTuple):
    """A folder's manifest checked against it: the command; ``ours``, listed files still as written (path ->
    ``file_record``); ``foreign``, listed files there but changed, replaced, a link or outside the folder."""

    command: str
    ours: dict[str, dict[str, Any]]
    foreign: list[str]


def _verified(folder: Path, name: str, record: dict[str, Any],
              hashed: dict[tuple[int, int], dict[str, Any]]) -> bool:
    # whether folder/name is a regular file inside folder matching record; hashed caches records by (device, inode)
    # so that a file a manifest names many times is read once
    target = inside(folder, name)
    try:
        found = os.lstat(target) if target is not None else None
        if found is None or not stat.S_ISREG(found.st_mode) or record.get("size") != found.st_size:
            return False
        key = (found.st_dev, found.st_ino)
        hashed[key] = hashed.get(key) or file_record(target)
        return hashed[key] == record
    except OSError:
        return False


def read_manifest(folder: str | os.PathLike) -> Manifest | None:
    """The manifest of ``folder`` checked file by file; None when there is none of ours."""
    folder = Path(folder)
    try:
        found = os.lstat(folder / MANIFEST)
        if not stat.S_ISREG(found.st_mode) or found.st_size > MAX_MANIFEST_BYTES:
            return None
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("command"), str) and isinstance(data.get("files"), list)):
        return None
    ours, foreign, hashed = {}, [], {}
    for entry in data["files"]:
        name = entry.get("path") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or not os.path.lexists(folder / name):
            continue
        record = {key: entry.get(key) for key in ("size", "sha256")} if isinstance(entry, dict) else {}
        if _verified(folder, name, record, hashed):
            ours[name] = record
        else:
            foreign.append(name)
    return Manifest(data["command"], ours, foreign)


class OwnedFolder:
    """An output folder a command owns, checked before any work and written through a staging folder.

    Its ``MANIFEST`` lists the files the command wrote (size, SHA-256). When every listed file still matches, they
    are the command's own: writing again replaces them and removes those not written again. Other files make the
    folder the user's: refused unless ``overwrite``, which replaces same-named files and keeps the rest.
    ``exclusive`` (a dataset) refuses the command's own output too unless ``overwrite``, which replaces it whole;
    ``legacy(folder)`` lists what the command wrote before manifests. Nothing is written or removed through a link
    or outside the folder; ``inputs`` held by the earlier output are refused.
    """

    def __init__(self, path: str | os.PathLike, command: str, *, overwrite: bool = False, exclusive: bool = False,
                 inputs: Sequence[str | os.PathLike] = (),
                 legacy: Callable[[Path], list[str]] | None = None) -> None:
        path = Path(path)
        if path.is_symlink():
            target = path.resolve()
            if target.exists() and not target.is_dir():
                raise ValueError(f"{path}: a link to {target}, which is not a folder to write into")
            path = target
        self.path, self.command, self.overwrite = output_folder(path), command, overwrite
        if os.path.lexists(path / MANIFEST) and not stat.S_ISREG(os.lstat(path / MANIFEST).st_mode):
            raise ValueError(f"{path / MANIFEST}: is not a regular file, and `vision-attn {command}` keeps its list "
                             "of what it wrote there; move it, or write elsewhere")
        manifest = read_manifest(path) if path.is_dir() else None
        own = manifest is not None and manifest.command == command and not manifest.foreign
        self.previous: dict[str, dict[str, Any] | None] = dict(manifest.ours) if own else {}
        try:
            held = [entry for entry in path.iterdir() if entry.name != MANIFEST
                    and not entry.name.startswith(STAGING_PREFIX)] if path.is_dir() else []
        except OSError as error:
            raise ValueError(f"{path}: cannot read it ({error.strerror or error}); choose a folder you can write "
                             "to") from None
        if held and not overwrite and (exclusive or not own):
            changed = manifest is not None and manifest.command == command and manifest.foreign
            what = (f"holds {manifest.foreign[0]}, which its manifest lists but `vision-attn {command}` did not "
                    "write as it is now" if changed else f"already holds what `vision-attn {command}` wrote" if own
                    else f"holds files that `vision-attn {command}` did not write")
            keep = "replace it" if exclusive else "write into it anyway (other files are kept)"
            raise FileExistsError(f"{path}: {what}; choose an empty folder, or pass --overwrite to {keep}")
        if held and overwrite and manifest is None and legacy is not None:
            self.previous = {name: None for name in legacy(path) if inside(path, name) is not None}
        writable_folder(path)
        earlier = {os.path.realpath(path / name) for name in self.previous}
        for item in inputs:
            if os.path.realpath(item) in earlier:
                raise ValueError(f"{item}: an earlier `vision-attn {command}` wrote it into {path}, and writing "
                                 "there again replaces it; copy it elsewhere first, or write to another folder")

    @contextmanager
    def staged(self) -> Iterator[Path]:
        """A hidden folder to write into: its files replace the earlier output when the block ends well."""
        made = [folder for folder in (self.path, *self.path.parents) if not folder.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
        try:
            yield staging
            self.commit(staging)
        except OSError as error:  # a full disk, a file too large: one line naming the folder, not a traceback
            named = [Path(name).resolve() for name in (error.filename, error.filename2) if name is not None]
            if named and not any(name.is_relative_to(self.path.resolve()) for name in named):
                raise  # not about this folder (an input's own error)
            raise ValueError(f"{self.path}: cannot be written ({error.strerror or error})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(made)  # the deepest first

    def _check_targets(self, entries: dict[str, bool], stale: Sequence[str]) -> None:
        # refuse, before anything changes, a target through a link, of the wrong kind, or (without overwrite) the user's
        for name, is_folder in entries.items():
            target, kind = self.path / name, "folder" if is_folder else "file"
            if inside(self.path, name) is None:
                raise FileExistsError(f"{target}: is a link, or under one; `vision-attn {self.command}` writes "
                                      f"nothing through a link (it could land outside {self.path}); move it, or "
                                      "write elsewhere")
            if not os.path.lexists(target) or name in stale:
                continue
            if target.is_dir() != is_folder or not (is_folder or target.is_file()):
                raise FileExistsError(f"{target}: is in the way of the {kind} `vision-attn {self.command}` writes "
                                      "there; move it, or write elsewhere")
            if not (is_folder or self.overwrite or name in self.previous):
                raise FileExistsError(f"{target}: is a file `vision-attn {self.command}` did not write; move it, "
                                      "or pass --overwrite to replace it")

    def commit(self, staging: Path) -> list[str]:
        """Move the files under ``staging`` into the folder, remove the earlier output's files not written again (if
        still as written) and list the new ones in the manifest; returns their relative paths."""
        entries = {p.relative_to(staging).as_posix(): p.is_dir() for p in sorted(staging.rglob("*"))}
        records = {name: file_record(staging / name) for name, is_folder in entries.items() if not is_folder}
        stale = sorted(set(self.previous) - set(records))
        self._check_targets(entries, stale)
        self._write_manifest({**{k: v for k, v in self.previous.items() if v is not None}, **records})
        for name in stale:  # only what is still ours: a file changed since the check stays
            record, target = self.previous[name], inside(self.path, name)
            if target is not None and (record is None or _verified(self.path, name, record, {})):
                target.unlink(missing_ok=True)
                _remove_empty(list(target.parents)[: len(Path(name).parts) - 1])
        for name, is_folder in entries.items():  # parents before their files, as sorted
            if is_folder:
                (self.path / name).mkdir(exist_ok=True)
            else:
                os.replace(staging / name, self.path / name)
        self._write_manifest(records)
        self.previous = dict(records)
        return list(records)

    def _write_manifest(self, records: dict[str, dict[str, Any]]) -> None:
        write_json_atomically(self.path / MANIFEST, {
            "written_by": "vision-attn", "command": self.command,
            "files": [{"path": name, **records[name]} for name in sorted(records)]})


def _remove_empty(folders: Sequence[Path]) -> None:  # in turn, up to the first that holds anything
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
