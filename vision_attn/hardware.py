"""What the machine's CPU computes natively, as the training and the benchmarks need to know it: its feature flags
(less the kernels torch and oneDNN were told not to use) and whether it has bf16 arithmetic. No Lightning, no torch:
``/proc/cpuinfo`` and the environment only.
"""

from __future__ import annotations

import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 CPUs with bf16 arithmetic


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is no such file), less those whose
    kernels torch and oneDNN were told not to use: ``ATEN_CPU_CAPABILITY`` below AVX-512 or ``ONEDNN_MAX_CPU_ISA``
    below AVX512_CORE drop the AVX-512 and AMX flags, an ``ONEDNN_MAX_CPU_ISA`` of AVX-512 without BF16, FP16 or
    AMX drops the bf16 and AMX ones (``scripts/slower_cpu.sh`` runs an AVX-512 machine as one without)."""
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
    """What to tell a user who trains in bf16 on a CPU without bf16 arithmetic (None when it does not apply, or
    when the flags are unknown). There every bf16 convolution and matmul is emulated, many times slower than fp32
    (docs/experiment-log.md has the figures)."""
    if not on_cpu or "bf16" not in str(precision) or not flags or has_native_bf16(flags):
        return None
    return (f"precision {precision} on a CPU without bf16 arithmetic (none of {', '.join(NATIVE_BF16_FLAGS)} in "
            "its flags): bf16 convolutions and matmuls are emulated here and can run tens of times slower than "
            "fp32 (VGG-19 at 224 px: 80× slower on an AVX2 CPU); use --trainer.precision 32-true")
