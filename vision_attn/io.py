"""Writing result files so that a crash never leaves a half-written file under the final name, and output folders
that a command owns: it replaces only what it wrote there (``OwnedFolder``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def replace_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write`` on a temporary file beside ``path``, then rename it into place (atomic on POSIX); if ``write``
    fails the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("wb", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                     delete=False) as file:
        try:
            write(file)
        except BaseException:
            file.close()
            os.unlink(file.name)
            raise
        temporary = Path(file.name)
    umask = os.umask(0)
    os.umask(umask)
    temporary.chmod(0o666 & ~umask)  # a normal file's permissions, not the temporary file's 0600
    temporary.replace(path)
    return path


def write_json_atomically(path: str | os.PathLike, payload: Any) -> Path:
    """Write JSON to ``path`` atomically."""
    text = json.dumps(payload, allow_nan=False)  # JSON has no NaN or Infinity: refused before anything is written
    return replace_atomically(path, lambda file: file.write(text.encode("utf-8")))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_parents(path: Path) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{path}: cannot be written, {parent} is a file, not a folder")
            return


def output_file(path: str | os.PathLike, *, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """A file a command will write, checked before any work: not a folder, not under a file, not one of ``inputs``."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a folder; give the name of a file to write")
    _check_parents(path)
    if any(_same_file(path, Path(item)) for item in inputs):
        raise ValueError(f"{path}: is one of the inputs; writing it would overwrite it (choose another output)")
    return path


def output_folder(path: str | os.PathLike) -> Path:
    """A folder a command will write into, checked before any work: not an existing file, not under a file."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path}: is a file, not a folder to write into")
    _check_parents(path)
    return path


def input_file(path: str | os.PathLike, what: str, *, error: type[Exception] = ValueError) -> Path:
    """A file a command reads, checked before it is opened: there, and not a folder, a pipe (opening it would block)
    or a device. ``what`` names it in the one-line errors ("a results JSON")."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a folder, not {what}")
    if path.exists() and not path.is_file():
        raise error(f"{path}: not a regular file (a pipe or a device?), so not {what}")
    if not path.is_file():
        raise (FileNotFoundError if error is ValueError else error)(f"{path}: no such file ({what} was expected)")
    return path


MANIFEST = ".vision-attn-manifest.json"  # in a folder a command wrote: the command and the files it wrote there
STAGING_PREFIX = ".vision-attn-staging-"  # a command writes into such a hidden folder, then moves the files in


def writable_folder(path: str | os.PathLike) -> Path:
    """Refuse, before any work, a folder that this process cannot create files in (or, when it is not there yet,
    the nearest folder above it that is)."""
    path = Path(path)
    existing = next((folder for folder in (path, *path.parents) if folder.exists()), Path.cwd())
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".vision-attn-probe-"):
            pass
    except OSError as error:
        raise ValueError(f"{path}: cannot write there ({error.strerror or error}: {existing}); choose a folder "
                         "you can write to") from None
    return path


def _listed(name: object) -> bool:
    parts = Path(name).parts if isinstance(name, str) else ()
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and name != MANIFEST


def read_manifest(folder: str | os.PathLike) -> tuple[str, list[str]] | None:
    """(command, relative paths of the files it wrote) from a folder's manifest, less paths that would leave the
    folder; None when there is none or it is not one of ours."""
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(data, dict) and isinstance(data.get("command"), str) and isinstance(data.get("files"), list)):
        return None
    return data["command"], [name for name in data["files"] if _listed(name)]


class OwnedFolder:
    """An output folder that a command owns, checked before any work and written through a staging folder.

    The command's manifest (``MANIFEST``) lists the files it wrote: writing again replaces them and removes the
    listed ones not written again; nothing else is touched. A folder with other files and no manifest of this
    command is refused unless ``overwrite`` (which keeps the other files). ``exclusive`` (a dataset, never a mix of
    two runs) refuses the command's own earlier output too unless ``overwrite``, which replaces it whole;
    ``legacy(folder)`` lists what the command wrote before it kept a manifest. A link to a folder is followed.
    ``inputs`` that the earlier output holds are refused, as writing would replace or remove them.
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
        self.path, self.command = output_folder(path), command
        manifest = read_manifest(path) if path.is_dir() else None
        own = manifest is not None and manifest[0] == command
        self.previous = manifest[1] if own else []
        try:
            held = [entry for entry in path.iterdir() if entry.name != MANIFEST
                    and not entry.name.startswith(STAGING_PREFIX)] if path.is_dir() else []
        except OSError as error:
            raise ValueError(f"{path}: cannot read it ({error.strerror or error}); choose a folder you can write "
                             "to") from None
        if held and not overwrite and (exclusive or not own):
            what = (f"already holds what `vision-attn {command}` wrote" if own
                    else f"holds files that `vision-attn {command}` did not write")
            keep = "replace it" if exclusive else "write into it anyway (other files are kept)"
            raise FileExistsError(f"{path}: {what}; choose an empty folder, or pass --overwrite to {keep}")
        if held and overwrite and not own and legacy is not None:
            self.previous = [name for name in legacy(path) if _listed(name)]
        writable_folder(path)
        earlier = {os.path.realpath(path / name) for name in self.previous}
        for item in inputs:
            if os.path.realpath(item) in earlier:
                raise ValueError(f"{item}: an earlier `vision-attn {command}` wrote it into {path}, and writing "
                                 "there again replaces it; copy it elsewhere first, or write to another folder")

    @contextmanager
    def staged(self) -> Iterator[Path]:
        """A hidden folder inside the output folder to write into: when the block ends well its files replace the
        earlier output (``commit``); on any failure, or Ctrl-C, it is removed with the folders made for it."""
        made = [folder for folder in (self.path, *self.path.parents) if not folder.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.path))
        try:
            yield staging
            self.commit(staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(made)  # the deepest first

    def commit(self, staging: Path) -> list[str]:
        """Move every file under ``staging`` into the folder, remove the earlier output's files that were not
        written again, and list what was written in the manifest; returns the relative paths written."""
        entries = {p.relative_to(staging).as_posix(): p.is_dir() for p in sorted(staging.rglob("*"))}
        written = [name for name, is_folder in entries.items() if not is_folder]
        stale = sorted(set(self.previous) - set(written))
        for name, is_folder in entries.items():  # a folder where a file goes, or a file where a folder goes
            target = self.path / name
            if target.exists() and target.is_dir() != is_folder and name not in stale:
                raise FileExistsError(f"{target}: is in the way of the {'folder' if is_folder else 'file'} "
                                      f"`vision-attn {self.command}` writes there; move it, or write elsewhere")
        self._write_manifest(sorted(set(self.previous) | set(written)))  # all ours, should the moves be cut short
        for name in stale:
            target = self.path / name
            if target.is_symlink() or target.is_file():
                target.unlink()
            _remove_empty(list(target.parents)[: len(Path(name).parts) - 1])
        for name, is_folder in entries.items():  # parents before their files, as sorted
            if is_folder:
                (self.path / name).mkdir(exist_ok=True)
            else:
                os.replace(staging / name, self.path / name)
        self._write_manifest(written)
        self.previous = written
        return written

    def _write_manifest(self, files: list[str]) -> None:
        write_json_atomically(self.path / MANIFEST, {"written_by": "vision-attn", "command": self.command,
                                                     "files": files})


def _remove_empty(folders: Sequence[Path]) -> None:
    """Remove the folders in turn, up to the first that holds anything."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
