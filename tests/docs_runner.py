"""Run the docs' examples as written: every ```bash and ```python block of the README and the guides.

A page's blocks run in order, in one sandbox folder seeded with what a reader would have (the repo's configs, a
few photos, small Fashion scenes, trained checkpoints at the paths the docs name), through real bash. Only
`vision-attn` itself is routed: bash's ``vision-attn`` is a function that asks a command server, over a socket on
127.0.0.1, to fork and run ``vision_attn.cli.main`` on the same argv in the sandbox, with tiny overrides appended
where a command would train for minutes. The server is a process of its own that imports torch, Lightning and
the package once and computes nothing itself (forking a process whose OpenMP threads have run can deadlock), so
each command starts in milliseconds instead of seconds. It also starts METEOR's Java process once (its tables take
seconds to load), and each child takes it over in turn, instead of every scoring command starting its own. Python
blocks run the same way, in a forked child. A block marked ``<!-- twin: tests/FILE.py::TEST (why) -->`` (it needs
COCO, a GPU or root) does not run here; its twin, which runs the same path on the CPU, must exist.

    python tests/docs_runner.py serve PORT_FILE     (the server; tests/test_docs_examples.py starts it)
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs" / "guides").glob("*.md")), REPO / "docs" / "cli.md",
         REPO / "docs" / "api" / "index.md"]
FENCE = re.compile(r"^```(\w*)\s*$")
TWIN = re.compile(r"<!--\s*twin:\s*(\S+?)::(\w+)\s*\(([^)]*)\)\s*-->")
TINY = REPO / "tests" / "configs" / "docs"
# The experiment config a fit names -> its tiny overrides (tests/configs/docs/); a fit of any other fails loudly.
TINY_FOR = {
    "configs/captioner/fashion_scenes.yaml": "captioner.yaml",
    "configs/captioner/fashion_scene_items.yaml": "items.yaml",
    "configs/vit/fashion_mnist.yaml": "vit.yaml",
    "configs/vit/fashion_mnist_canvas.yaml": "vit.yaml",
    "configs/vit/fashion_mnist_teacher.yaml": "convnet.yaml",
    "configs/vit/cifar10.yaml": "cifar10.yaml",
    "configs/vit/imagefolder.yaml": "imagefolder.yaml",
}
COUNT_CAPS = {"make-scenes": {"--train": 12, "--val": 4, "--test": 4}, "rollout-mass": {"--count": 16},
              "export-samples": {"--count": 4}, "erasure": {"--count": 4}, "deletion": {"--count": 16}}
# Send this shell's folder, its log and its arguments to the server; the server answers with the exit status.
CALL = r"""exec 3<>"/dev/tcp/127.0.0.1/$DOCS_RUNNER_PORT"
printf '%s\0' "$#" "$PWD" "$DOCS_RUNNER_LOG" "$@" >&3
read -r status <&3
exec 3>&-
"""
PRELUDE = "set -eo pipefail\nvision-attn() {\n    local status\n" + CALL + '    return "$status"\n}\n'
SHIM = "#!/usr/bin/env bash\n" + CALL + 'exit "$status"\n'  # a `vision-attn` executable that does the same
PYTHON_BLOCK = "--docs-python-block"  # the first argument that makes the server run a Python file instead


@dataclass(frozen=True)
class Example:
    """One fenced block of a page: its language, code, line, and its twin test when it is not run here."""

    page: Path
    line: int
    language: str
    code: str
    twin: tuple[str, str, str] | None

    @property
    def where(self) -> str:
        """The block's page and line, for messages."""
        return f"{self.page.relative_to(REPO)}:{self.line}"


def examples(page: Path) -> list[Example]:
    """The ```bash and ```python blocks of a page, in order, each with the twin marker on the line above it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening or not opening.group(1):
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        twin = TWIN.search(lines[index - 1]) if index else None
        if opening.group(1) in ("bash", "python"):
            found.append(Example(page, index + 1, opening.group(1), "\n".join(lines[index + 1:end]) + "\n",
                                 twin.groups() if twin else None))
        index = end + 1
    return found


def tiny_argv(argv: list[str]) -> list[str]:
    """The argv a docs example gives, with the tiny overrides appended (jsonargparse and argparse let the last
    value win) or counts capped, and the GPU trainer swapped for the CPU one (these tests have no GPU); raises
    for a fit of a config the runner has no tiny overrides for."""
    command = argv[0] if argv else ""
    if command in ("fit", "validate", "test", "predict"):
        if "--print_config" in argv or "--help" in argv:
            return argv
        named = [arg for arg in argv if arg in TINY_FOR]
        if len(named) != 1:
            raise ValueError(f"docs example `vision-attn {' '.join(argv)}`: give tests/docs_runner.py's TINY_FOR "
                             "tiny overrides for its experiment config")
        on_cpu = ["configs/trainer/cpu.yaml" if arg == "configs/trainer/gpu.yaml" else arg for arg in argv]
        return [*on_cpu, "--config", str(TINY / "trainer.yaml"), "--config", str(TINY / TINY_FOR[named[0]])]
    if command == "benchmark":
        return [*argv, "--quick", "--out", "benchmark.json"]
    caps = COUNT_CAPS.get(command, {})
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in caps and out[i + 1].isdigit():
            out[i + 1] = str(min(int(out[i + 1]), caps[arg]))
    return out


class CommandServer:
    """The server process, seen from the tests: start it once, then ``run_bash`` and ``run_python`` blocks."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        port_file = folder / "port"
        self.process = subprocess.Popen([sys.executable, __file__, "serve", str(port_file)], env=env, cwd=folder,
                                        stdout=subprocess.DEVNULL, stderr=open(folder / "server.log", "w"))  # noqa: SIM115
        deadline = time.monotonic() + 120
        while not port_file.is_file() or not port_file.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the docs' command server did not start: {(folder / 'server.log').read_text()}")
            time.sleep(0.1)
        self.port = port_file.read_text().strip()
        self.env = env

    def run_bash(self, code: str, cwd: Path, log: Path, timeout: float = 900) -> int:
        """Run ``code`` in bash in ``cwd``; its ``vision-attn`` calls run in the server's forked children."""
        env = {**self.env, "DOCS_RUNNER_PORT": self.port, "DOCS_RUNNER_LOG": str(log)}
        with open(log, "a", encoding="utf-8") as out:
            return subprocess.run(["bash", "-c", PRELUDE + code], cwd=cwd, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode

    def run_python(self, code: str, cwd: Path, log: Path) -> int:
        """Run a Python block in a forked child of the server, in ``cwd``, as a script would run."""
        script = cwd / ".docs_block.py"
        script.write_text(code, encoding="utf-8")
        return self.run_bash(f'vision-attn {PYTHON_BLOCK} "{script}"', cwd, log)

    def close(self) -> None:
        """Stop the server."""
        self.process.kill()
        self.process.wait()


def _receive(connection: socket.socket) -> list[str]:
    data = b""
    while chunk := connection.recv(65536):
        data += chunk
        fields = data.split(b"\0")
        if len(fields) > 1 and len(fields) - 1 >= int(fields[0]) + 3:
            break
    return [field.decode() for field in data.split(b"\0")[:-1]]


def _take_over_meteor() -> None:
    """In a forked child: use the server's METEOR scorer as this process's own (the children run one at a time).
    Its Java process is the server's child, so ``Popen.poll`` here cannot wait on it and would call it ended;
    /proc tells whether it still runs (a zombie is one a child before this one killed)."""
    from vision_attn import metrics

    scorer = metrics._meteor
    if scorer is None:
        return
    stat = Path(f"/proc/{scorer.meteor_p.pid}/stat")

    def poll() -> int | None:
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return 1
        return 1 if state in ("Z", "X") else None

    scorer.meteor_p.poll = poll
    metrics._meteor_pid = os.getpid()


def _child(cwd: str, log: str, argv: list[str]) -> None:
    """In a forked child: the sandbox's folder and log, then the command or the Python block; never returns."""
    code = 1
    _take_over_meteor()
    try:
        os.chdir(cwd)
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's whole life
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if argv[:1] == [PYTHON_BLOCK]:
            source = Path(argv[1]).read_text(encoding="utf-8")
            exec(compile(source, argv[1], "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
        else:
            from vision_attn.cli import main

            rewritten = tiny_argv(argv)
            print(f"$ vision-attn {' '.join(rewritten)}", flush=True)
            main(rewritten)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the log, as the command line would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(port_file: Path) -> None:
    """Import everything once, then fork a child for each request until killed."""
    import lightning  # noqa: F401 - imported once here, so that no child imports it
    import torch  # noqa: F401

    import vision_attn.api  # noqa: F401
    import vision_attn.cli  # noqa: F401
    import vision_attn.datamodules  # noqa: F401
    import vision_attn.tasks  # noqa: F401
    import vision_attn.trainer_cli  # noqa: F401
    from vision_attn import metrics

    if metrics.java_available():
        metrics.meteor_scorer()  # Java and METEOR's tables loaded once, not in every command that scores

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port_file.write_text(str(server.getsockname()[1]))
        while True:
            connection, _ = server.accept()
            with connection:
                fields = _receive(connection)
                cwd, log, argv = fields[1], fields[2], fields[3:]
                pid = os.fork()
                if pid == 0:
                    server.close()
                    _child(cwd, log, argv)
                status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                connection.sendall(f"{status}\n".encode())


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(Path(sys.argv[2]))
