"""The suite's own preflight: too little room for its temporary files stops it at once, in one line."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_too_little_room_for_temporary_files_stops_the_suite_in_one_line_before_any_test():
    # Ask for far more than any disk has: the real free space, compared with a need no machine meets.
    env = {**os.environ, "VISION_ATTN_TEST_TMP_GIB": "1e9", "PYTEST_ADDOPTS": ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "tests/test_suite_preflight.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "the tests need about 1e+09 GiB for their temporary files" in out
    assert "set TMPDIR" in out
    assert "passed" not in out and "Traceback" not in out
