"""Commands own their output folders: each of overlay, explore, export-samples and make-scenes lists what it wrote in
the folder's manifest, replaces only that when run again, refuses a folder holding other files unless --overwrite
(which keeps them), follows a symlinked --out, refuses a read-only folder before any work, and leaves no staging
folder behind; make-scenes never leaves a dataset that mixes two runs."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_each_in_a_fresh_process, run_in_process, tiny
from tests.test_bad_paths import snapshot
from vision_attn.io import MANIFEST, STAGING_PREFIX

COMMANDS = ("overlay", "explore", "export-samples", "make-scenes")


@pytest.fixture(scope="module")
def captions(tmp_path_factory, trained_captioner) -> dict[str, Path]:
    """Three scene images, and `caption`'s results JSON of all three and of the first only."""
    work = tmp_path_factory.mktemp("owned")
    images = work / "images"
    images.mkdir()
    for number in (1, 2, 3):
        shutil.copy(trained_captioner["scenes"] / "images" / "test" / f"{number}.png", images / f"scene{number}.png")
    for name, chosen in (("all.json", sorted(images.iterdir())), ("one.json", [images / "scene1.png"])):
        result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), *map(str, chosen),
                                "--out", str(work / name))
        assert result.returncode == 0, result.stderr[-2000:]
    return {"images": images, "all": work / "all.json", "one": work / "one.json"}


def command_args(command: str, captions: dict[str, Path], out: Path, *, smaller: bool = False) -> list[str]:
    """``vision-attn COMMAND`` writing into ``out``; ``smaller`` writes fewer files than the first run."""
    results = str(captions["one" if smaller else "all"])
    return {"overlay": ["overlay", results, "--panel-size", "32", "--out", str(out)],
            "explore": ["explore", results, "--out", str(out)],
            "export-samples": ["export-samples", "--count", "1" if smaller else "3", "--seed", "2" if smaller else "0",
                               "--out", str(out)],
            "make-scenes": ["make-scenes", "--train", "1" if smaller else "3", "--val", "1", "--test", "0",
                            "--root", str(out)]}[command]


def one_line_error(result: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2 and exactly one line on stderr, ``error: ...``, holding each of ``expected``."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-2000:]
    assert all(text in errors[0] for text in expected), errors[0]
    return errors[0]


def manifest_files(folder: Path) -> list[str]:
    """The files the manifest in ``folder`` lists; they must all be there."""
    listed = [entry["path"] for entry in json.loads((folder / MANIFEST).read_text())["files"]]
    assert listed and all((folder / name).is_file() for name in listed), listed
    return listed


def files_in(folder: Path) -> set[str]:
    """Every file under ``folder``, relative."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def add_users_files(folder: Path) -> dict[str, bytes]:
    """A note and a subfolder with a file of the user's in ``folder``; returns their bytes by relative path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("my notes, keep them")
    (folder / "mine").mkdir(exist_ok=True)
    (folder / "mine" / "draft.png").write_bytes(b"not even a png")
    return {"notes.txt": b"my notes, keep them", "mine/draft.png": b"not even a png"}


@pytest.mark.parametrize("command", COMMANDS)
def test_a_folder_of_the_users_is_refused_and_with_overwrite_kept(command, captions, tmp_path) -> None:
    out = tmp_path / "out"
    users = add_users_files(out)
    before = snapshot(tmp_path)
    refused = run_in_process(*command_args(command, captions, out))
    one_line_error(refused, str(out), "did not write", "--overwrite")
    assert snapshot(tmp_path) == before  # refused before any work: nothing written, nothing removed
    written = run_in_process(*command_args(command, captions, out), "--overwrite")
    assert written.returncode == 0, written.stderr[-2000:]
    listed = manifest_files(out)
    assert files_in(out) == {*listed, *users, MANIFEST}
    assert all((out / name).read_bytes() == data for name, data in users.items())
    again = run_in_process(*command_args(command, captions, out, smaller=True), "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    assert files_in(out) == {*manifest_files(out), *users, MANIFEST}  # its earlier files gone, the user's kept
    assert all((out / name).read_bytes() == data for name, data in users.items())
    assert not list(out.glob(f"{STAGING_PREFIX}*"))


@pytest.mark.parametrize("command", ("overlay", "explore", "export-samples"))
def test_a_rerun_into_its_own_folder_replaces_only_its_files(command, captions, tmp_path) -> None:
    out = tmp_path / "out"
    first = run_in_process(*command_args(command, captions, out))
    assert first.returncode == 0, first.stderr[-2000:]
    earlier = manifest_files(out)
    users = add_users_files(out)  # the user adds notes to the folder afterwards
    second = run_in_process(*command_args(command, captions, out, smaller=True))  # no --overwrite needed
    assert second.returncode == 0, second.stderr[-2000:]
    now = manifest_files(out)
    assert set(earlier) - set(now), "the smaller run should write fewer files"
    assert files_in(out) == {*now, *users, MANIFEST}  # what it no longer writes is gone; the user's files stay
    assert all((out / name).read_bytes() == data for name, data in users.items())
    other = "explore" if command != "explore" else "overlay"  # another command's folder is not its own
    refused = run_in_process(*command_args(other, captions, out))
    one_line_error(refused, "did not write", "--overwrite")


def test_make_scenes_rerun_with_fewer_scenes_is_never_a_mix(captions, tmp_path) -> None:
    root = tmp_path / "scenes"
    assert run_in_process(*command_args("make-scenes", captions, root)).returncode == 0
    before = snapshot(root)
    again = run_in_process(*command_args("make-scenes", captions, root, smaller=True))
    one_line_error(again, str(root), "already holds", "--overwrite")  # even its own dataset, without --overwrite
    assert snapshot(root) == before
    users = add_users_files(root)
    replaced = run_in_process(*command_args("make-scenes", captions, root, smaller=True), "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    listed = json.loads((root / "annotations" / "captions_train.json").read_text())["images"]
    assert sorted(p.name for p in (root / "images" / "train").iterdir()) == [image["file_name"] for image in listed]
    assert files_in(root) == {*manifest_files(root), *users, MANIFEST}
    # a dataset written before make-scenes kept a manifest: --overwrite removes its numbered PNGs and annotations
    (root / MANIFEST).unlink()
    shutil.copy(root / "images" / "train" / "1.png", root / "images" / "train" / "7.png")  # an old, larger run's
    legacy = run_in_process(*command_args("make-scenes", captions, root, smaller=True), "--overwrite")
    assert legacy.returncode == 0, legacy.stderr[-2000:]
    assert sorted(p.name for p in (root / "images" / "train").iterdir()) == ["1.png"]
    assert all((root / name).read_bytes() == data for name, data in users.items())


@pytest.mark.parametrize("command", ("explore", "export-samples"))
def test_a_symlinked_out_writes_into_its_target(command, captions, tmp_path) -> None:
    target, link = tmp_path / "real", tmp_path / "link"
    assert run_in_process(*command_args(command, captions, target)).returncode == 0
    link.symlink_to(target, target_is_directory=True)
    again = run_in_process(*command_args(command, captions, link, smaller=True))  # replaced through the link
    assert again.returncode == 0, again.stderr[-2000:]
    assert link.is_symlink() and files_in(target) == {*manifest_files(target), MANIFEST}
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "to_a_file").symlink_to(tmp_path / "file.txt")
    refused = run_in_process(*command_args(command, captions, tmp_path / "to_a_file"))
    one_line_error(refused, "to_a_file", "not a folder")
    assert (tmp_path / "file.txt").read_text() == "x"


def test_a_failure_midway_leaves_the_earlier_output_and_no_staging(captions, tmp_path) -> None:
    out = tmp_path / "out"
    assert run_in_process(*command_args("overlay", captions, out)).returncode == 0
    before = snapshot(out)
    records = json.loads(captions["all"].read_text())
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not the rest of a PNG")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([records[0], {**records[1], "file_name": str(broken)}]))
    failed = run_in_process("overlay", str(bad), "--panel-size", "32", "--out", str(out))
    one_line_error(failed, "broken.png")  # after drawing the first overlay
    assert snapshot(out) == before and not list(out.glob(f"{STAGING_PREFIX}*"))
    fresh = tmp_path / "fresh" / "deeper"
    failed = run_in_process("overlay", str(bad), "--panel-size", "32", "--out", str(fresh))
    one_line_error(failed, "broken.png")
    assert not (tmp_path / "fresh").exists()  # the folders made for it are gone too


def without_write_permission() -> list[str] | None:
    """The command prefix that makes a folder's permissions count: none for a user; as root, setpriv dropping the
    capabilities that ignore them. None when root has no setpriv."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"] if setpriv else None


def test_a_read_only_folder_is_one_line_before_any_work(captions, trained_captioner, tmp_path) -> None:
    prefix = without_write_permission()
    if prefix is None:
        pytest.skip("running as root without setpriv: a read-only folder would still be writable")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "site").mkdir()  # an existing folder inside, and folders still to be made
    runs = {"explore": command_args("explore", captions, locked / "site"),
            "overlay": command_args("overlay", captions, locked / "overlays"),
            "export-samples": command_args("export-samples", captions, locked / "samples"),
            "make-scenes": command_args("make-scenes", captions, locked / "scenes"),
            "cache-features": ["cache-features", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                               str(trained_captioner["scenes"]), "--model.init_args.encoder.trainable_stages", "0",
                               "--data.init_args.feature_cache.folder", str(locked / "cache")]}
    locked.chmod(0o555)
    (locked / "site").chmod(0o555)
    try:
        results = run_each_in_a_fresh_process(list(runs.values()), prefix=prefix)
    finally:
        (locked / "site").chmod(0o755)
        locked.chmod(0o755)
    for result in results:
        one_line_error(result, "cannot write there", str(locked))
    assert sorted(p.relative_to(locked).as_posix() for p in locked.rglob("*")) == ["site"]


def planted(folder: Path, command: str, files: list) -> None:
    """A manifest in ``folder`` that names ``command`` as its writer and lists ``files``, as anyone could write it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).write_text(json.dumps({"written_by": "vision-attn", "command": command, "files": files}))


def sha256_record(path: Path) -> dict:
    return {"path": "", "size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


@pytest.mark.parametrize("entries", ["names", "true records", "false records"])
def test_a_planted_manifest_removes_nothing_of_the_users(entries, captions, tmp_path) -> None:
    """The probes' planted manifest: it names `overlay`, lists a file of the user's and one outside --out through a
    symlinked subfolder (with their true size and hash, too), an absolute path and a `..` path. Refused without
    --overwrite; with it, every one of those files stays."""
    out, elsewhere = tmp_path / "given", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim.txt").write_text("outside --out, reached through sub/")
    (tmp_path / "above.txt").write_text("above --out")
    out.mkdir()
    (out / "user.txt").write_text("the user's")
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    names = ["sub/victim.txt", "user.txt", str(tmp_path / "above.txt"), "../above.txt"]
    files = {"names": names,
             "true records": [{**sha256_record(out / name), "path": name} for name in names],
             "false records": [{"path": name, "size": 1, "sha256": "0" * 64} for name in names]}[entries]
    planted(out, "overlay", files)
    before = snapshot(tmp_path)
    one_line_error(run_in_process(*command_args("overlay", captions, out)), str(out), "--overwrite")
    assert snapshot(tmp_path) == before
    written = run_in_process(*command_args("overlay", captions, out), "--overwrite")
    assert written.returncode == 0, written.stderr[-2000:]
    kept = {name: data for name, data in before.items() if not name.startswith("given/.vision-attn")}
    assert {name: data for name, data in snapshot(tmp_path).items() if name in kept} == kept
    assert (out / "sub").is_symlink() and files_in(elsewhere) == {"victim.txt"}


@pytest.mark.parametrize("kind", ["fifo", "folder", "link"])
def test_a_manifest_that_is_not_a_regular_file_is_one_line(kind, captions, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    {"fifo": lambda: os.mkfifo(out / MANIFEST), "folder": lambda: (out / MANIFEST).mkdir(),
     "link": lambda: (out / MANIFEST).symlink_to(tmp_path / "anywhere.json")}[kind]()
    one_line_error(run_in_process(*command_args("overlay", captions, out)), MANIFEST, "not a regular file")
    assert files_in(out) == set()


@pytest.mark.parametrize("command", ("explore", "make-scenes"))
def test_symlinked_subfolders_of_an_owned_folder_are_never_written_through(command, captions, tmp_path) -> None:
    """An old site's (or dataset's) subfolders linked to another folder: refused without --overwrite, and with it
    refused in one line before anything moves; the other folder is as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    assert run_in_process(*command_args(command, captions, out)).returncode == 0
    elsewhere.mkdir()
    for sub in ("images", "data" if command == "explore" else "annotations"):
        shutil.move(out / sub, elsewhere / sub)
        (out / sub).symlink_to(elsewhere / sub, target_is_directory=True)
    before = snapshot(tmp_path)
    one_line_error(run_in_process(*command_args(command, captions, out)), str(out), "--overwrite")
    refused = run_in_process(*command_args(command, captions, out), "--overwrite")
    one_line_error(refused, "is a link", "writes nothing through a link")
    assert snapshot(tmp_path) == before and not list(out.glob(f"{STAGING_PREFIX}*"))


@pytest.mark.parametrize("change", ["edited", "renamed", "hard-linked"])
def test_a_file_changed_since_it_was_written_is_the_users(change, captions, tmp_path) -> None:
    """One of overlay's PNGs edited, renamed (the user's own file put at its name) or hard-linked from elsewhere:
    the folder is no longer overlay's own (refused without --overwrite), and a rerun that no longer writes that
    name keeps the user's bytes; a hard link outside keeps its content whatever is replaced."""
    out = tmp_path / "out"
    assert run_in_process(*command_args("overlay", captions, out)).returncode == 0
    smaller = run_in_process(*command_args("overlay", captions, tmp_path / "probe", smaller=True))
    assert smaller.returncode == 0
    dropped = sorted(set(manifest_files(out)) - set(manifest_files(tmp_path / "probe")))[0]
    target, outside = out / dropped, tmp_path / "kept.png"
    ours = target.read_bytes()
    if change == "edited":
        target.write_bytes(ours + b"the user's edit")
    elif change == "renamed":
        target.rename(out / "mine.png")
        target.write_bytes(b"the user's own file")
    else:
        os.link(target, outside)
    users = target.read_bytes()
    if change != "hard-linked":
        one_line_error(run_in_process(*command_args("overlay", captions, out, smaller=True)), dropped, "--overwrite")
    again = run_in_process(*command_args("overlay", captions, out, smaller=True), "--overwrite")
    assert again.returncode == 0, again.stderr[-2000:]
    if change == "hard-linked":  # still ours by content, so removed; the other link keeps it
        assert not target.exists() and outside.read_bytes() == ours
    else:
        assert target.read_bytes() == users
    if change == "renamed":
        assert (out / "mine.png").read_bytes() == ours


def is_null_device(path: str) -> bool:
    mode = os.stat(path).st_mode
    return stat.S_ISCHR(mode) and os.major(os.stat(path).st_rdev) == 1


@pytest.fixture
def devices_kept():
    """/dev/null and /dev/full as they were, checked after the test (restored, as root, should a bug replace one, so
    that the rest of the machine is not broken by a failing test)."""
    yield
    for name, minor in (("/dev/null", 3), ("/dev/full", 7)):
        if os.path.lexists(name) and not is_null_device(name) and os.geteuid() == 0:
            os.unlink(name)
            os.mknod(name, stat.S_IFCHR | 0o666, os.makedev(1, minor))
            os.chmod(name, 0o666)
            pytest.fail(f"{name} was replaced (restored)")


@pytest.mark.parametrize("target", ["/dev/null", "/dev/full", "fifo", "folder"])
def test_an_out_that_is_not_a_regular_file_is_refused_before_any_work(target, captions, trained_captioner,
                                                                       devices_kept, tmp_path) -> None:
    """As root a rename would replace /dev/null with a regular file: every command refuses such an --out in one
    line, and it stays what it was."""
    if target == "fifo":
        target = str(tmp_path / "fifo")
        os.mkfifo(target)
    elif target == "folder":
        target = str(tmp_path / "folder.json")
        os.mkdir(target)
    ckpt, scenes = str(trained_captioner["ckpt"]), trained_captioner["scenes"]
    runs = [["caption", "--ckpt", ckpt, str(captions["images"] / "scene1.png"), "--out", target],
            ["evaluate", str(captions["all"]), "--annotations", str(scenes / "annotations" / "captions_test.json"),
             "--out", target],
            ["erasure", "--ckpt", ckpt, "--root", str(scenes), "--count", "1", "--out", target],
            ["classify", "--ckpt", ckpt, str(captions["images"] / "scene1.png"), "--out", target]]
    for args in runs:
        one_line_error(run_in_process(*args), target, "regular file" if "folder" not in target else "is a folder")
    for folder_command in ("overlay", "explore", "export-samples"):
        if "folder" not in target:
            one_line_error(run_in_process(*command_args(folder_command, captions, Path(target))), target,
                           "not a folder")
    if target.startswith("/dev/"):
        assert is_null_device(target)
    else:
        assert stat.S_ISFIFO(os.stat(target).st_mode) if "fifo" in target else Path(target).is_dir()


def test_erasure_never_writes_over_its_dataset(trained_captioner, tmp_path) -> None:
    """The probes' `erasure --root ROOT --out ROOT/annotations/instances_test.json`: any file of the dataset, by its
    path, a symlink or a hard link, is refused in one line, and the dataset is as it was."""
    scenes = trained_captioner["scenes"]
    before = snapshot(scenes)
    link, hard = tmp_path / "link.json", tmp_path / "hard.json"
    link.symlink_to(scenes / "annotations" / "instances_test.json")
    os.link(scenes / "annotations" / "captions_train.json", hard)
    for out in (scenes / "annotations" / "instances_test.json", scenes / "annotations" / "captions_val.json",
                scenes / "images" / "test" / "1.png", link, hard):
        refused = run_in_process("erasure", "--ckpt", str(trained_captioner["ckpt"]), "--root", str(scenes),
                                 "--count", "1", "--out", str(out))
        one_line_error(refused, str(out), "is one of the inputs")
    assert snapshot(scenes) == before


def test_an_output_the_kernel_refuses_is_one_line_before_any_work(captions, trained_captioner, tmp_path) -> None:
    """Root may write anywhere the permission bits say, yet /proc takes no new file: `--out` there is refused
    before any image is captioned."""
    result = run_in_process("caption", "--ckpt", str(trained_captioner["ckpt"]), str(captions["images"]), "--out",
                            "/proc/vision-attn-results.json")
    one_line_error(result, "/proc: cannot write there")
    assert result.stdout == ""  # nothing captioned


def test_a_file_too_large_for_the_disk_is_one_line_and_leaves_nothing(captions, trained_captioner, tmp_path) -> None:
    """Files capped at 4 KiB (RLIMIT_FSIZE, as a full disk or a quota would stop them): each command, a fit's
    checkpoints and figures among them, ends in one line naming its output, and leaves no temporary file or staging
    folder behind."""
    import resource
    import signal

    def capped() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    commands = [["caption", "--ckpt", str(trained_captioner["ckpt"]), str(captions["images"]), "--all-beams", "--out",
                 str(tmp_path / "results.json")], command_args("explore", captions, tmp_path / "site"),
                command_args("overlay", captions, tmp_path / "overlays"),
                ["fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir", str(tmp_path / "run")]]
    for result in run_each_in_a_fresh_process(commands, preexec_fn=capped):
        one_line_error(result, "cannot be written (File too large)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], list(tmp_path.rglob("*"))  # the fit's folder
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")], list(tmp_path.rglob("*"))
