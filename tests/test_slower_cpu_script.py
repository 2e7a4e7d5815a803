"""scripts/slower_cpu.sh: the stand-in for the slower machine refuses bad input in one line, and runs a command
with AVX2 code paths, two threads and its own CPU-quota cgroup (where the host lets it make one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slower_cpu.sh"


GROUP = "vision-attn-slower-test"  # not the default group: the suite itself may run inside that one


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLOWER_CPU_GROUP": GROUP})


@pytest.mark.parametrize(("args", "message"), [
    ((), "usage: scripts/slower_cpu.sh"),
    (("--cpus",), "--cpus needs a number of processors"),
    (("--cpus", "abc", "true"), "--cpus must be a number of processors above 0, got 'abc'"),
    (("--cpus", "-1", "true"), "--cpus must be a number of processors above 0, got '-1'"),
    (("no-such-command-here",), "no such command: no-such-command-here"),
])
def test_bad_input_gets_one_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    result = run(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr


def test_the_command_runs_on_avx2_paths_in_its_own_quota_group() -> None:
    probe = ("import os, torch; print(os.environ['OMP_NUM_THREADS'], torch.backends.cpu.get_cpu_capability(), "
             "os.environ['ONEDNN_MAX_CPU_ISA']); print(open('/proc/self/cgroup').read())")
    result = run("--cpus", "1.5", sys.executable, "-c", probe)
    if result.returncode == 2 and ("cannot" in result.stderr or "no cgroup" in result.stderr):
        pytest.skip(f"this host does not let the script limit CPU time: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    first, *groups = result.stdout.splitlines()
    assert first.split() == ["2", "AVX2", "AVX2"]  # torch dispatches its AVX2 kernels, not AVX-512's
    assert any(line.endswith("/" + GROUP) for line in groups)
    quota = Path(f"/sys/fs/cgroup/cpu/{GROUP}/cpu.cfs_quota_us")
    limit = Path(f"/sys/fs/cgroup/{GROUP}/cpu.max")
    assert (quota.exists() and quota.read_text().split() == ["150000"]) or \
        (limit.exists() and limit.read_text().split()[0] == "150000")
