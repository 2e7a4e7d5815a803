"""What the machine's CPU computes natively (its feature flags, bf16 arithmetic), from ``/proc/cpuinfo`` and the
environment only: no Lightning, no torch."""

from __future__ import annotations

import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 CPUs with bf16 arithmetic


def cpu_flags() -> set[str]:
    """The CPU's feature flags in /proc/cpuinfo (empty without it), less those whose kernels torch and oneDNN were
    told not to use (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``: ``scripts/slower_cpu.sh``)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    below_avx512 = aten in ("default", "avx2") or (
        onednn not in ("", "ALL") and not onednn.startswith(("AVX512", "AVX10")) and "AMX" not in onednn)
    if below_avx512:
        return {flag for flag in flags if not flag.startswith(("avx512", "amx"))}
    if onednn.startswith("AVX512") and not any(part in onednn for part in ("BF16", "FP16", "AMX")):
        return {flag for flag in flags if flag != "avx512_bf16" and not flag.startswith("amx")}
    return flags


def has_native_bf16(flags: set[str]) -> bool:
    """Whether CPU ``flags`` (``cpu_flags()``) include bf16 arithmetic."""
    return bool(flags & set(NATIVE_BF16_FLAGS))


def bf16_warning(precision: str, on_cpu: bool, flags: set[str]) -> str | None:
    """The warning for training in bf16 on a CPU without bf16 arithmetic, where it is emulated (None when it does
    not apply, or the flags are unknown)."""
    if not on_cpu or "bf16" not in str(precision) or not flags or has_native_bf16(flags):
        return None
    return (f"precision {precision} on a CPU without bf16 arithmetic (none of {', '.join(NATIVE_BF16_FLAGS)} in "
            "its flags): bf16 convolutions and matmuls are emulated here and can run tens of times slower than "
            "fp32 (VGG-19 at 224 px: 80× slower on an AVX2 CPU); use --trainer.precision 32-true")
