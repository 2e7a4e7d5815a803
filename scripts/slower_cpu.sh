#!/bin/sh
# Run a command as on the slower kind of machine the time-boxed defaults must fit (2 cores without AVX-512).
#
#     sudo scripts/slower_cpu.sh [--cpus 1.4] COMMAND [ARG ...]      e.g.  sudo scripts/slower_cpu.sh make demo
#
# The command runs with torch's and oneDNN's AVX2 code paths only (ATEN_CPU_CAPABILITY=avx2,
# ONEDNN_MAX_CPU_ISA=AVX2: the kernels a CPU without AVX-512 runs), two threads, and a CPU quota of --cpus
# processors (a CFS bandwidth limit in a cgroup of its own, v2's cpu.max or v1's cpu.cfs_quota_us; needs root).
# 1.4 was calibrated on 2026-11-25 on 2 cores of an AMD EPYC family 25 model 17 (AVX-512) against the slower AMD
# EPYC family 25 model 1 (no AVX-512), on the step counts of commit 31413ff's two time-boxed fits; the figures, and
# the later comparisons phase by phase, are in docs/benchmarks.md ("Machines" and "The stand-in, phase by phase").
# A quota cannot slow a single-threaded phase the way a slower core does: the scenes' drawing with clutter,
# self-critical sampling and CIDEr-D rewards keep one core busy, stay under the quota, and run at the host core's
# full speed. So the stand-in is too fast for the captioner and the encoder pretraining, and close for the
# matmul-bound ViT: multiply a phase's time under it by that phase's correction in docs/benchmarks.md before
# comparing it with a goal. The test suite's time is projected better without the stand-in: time the suite on
# the host alone and use the same-suite ratio given there. On another host, calibrate --cpus the same way before
# trusting its figures. The
# cgroup is named by $SLOWER_CPU_GROUP (default vision-attn-slower), so that a run inside one can start another
# with a quota of its own.
set -eu
cpus=1.4
if [ "${1:-}" = "--cpus" ]; then
    [ $# -ge 2 ] || { echo "slower_cpu.sh: --cpus needs a number of processors, e.g. --cpus 1.4" >&2; exit 2; }
    cpus=$2
    shift 2
fi
[ $# -ge 1 ] || { echo "usage: scripts/slower_cpu.sh [--cpus N] COMMAND [ARG ...]" >&2; exit 2; }
quota=$(awk -v c="$cpus" 'BEGIN { if (c + 0 > 0 && c + 0 <= 1024) printf "%d", c * 100000; else print "" }')
[ -n "$quota" ] || { echo "slower_cpu.sh: --cpus must be a number of processors above 0, got '$cpus'" >&2; exit 2; }
command -v "$1" >/dev/null 2>&1 || { echo "slower_cpu.sh: no such command: $1" >&2; exit 2; }
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    group=/sys/fs/cgroup/${SLOWER_CPU_GROUP:-vision-attn-slower}  # cgroup v2: its parent must hand it the cpu controller
    echo +cpu > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    mkdir -p "$group" 2>/dev/null && echo "$quota 100000" > "$group/cpu.max" 2>/dev/null \
        || { echo "slower_cpu.sh: cannot set $group/cpu.max (root, and the cpu controller enabled, are needed)" >&2; exit 2; }
elif [ -d /sys/fs/cgroup/cpu ]; then
    group=/sys/fs/cgroup/cpu/${SLOWER_CPU_GROUP:-vision-attn-slower}  # cgroup v1
    mkdir -p "$group" 2>/dev/null && echo 100000 > "$group/cpu.cfs_period_us" 2>/dev/null \
        && echo "$quota" > "$group/cpu.cfs_quota_us" 2>/dev/null \
        || { echo "slower_cpu.sh: cannot set $group/cpu.cfs_quota_us (run as root)" >&2; exit 2; }
else
    echo "slower_cpu.sh: no cgroup cpu controller under /sys/fs/cgroup to limit the command's CPU time" >&2
    exit 2
fi
echo $$ > "$group/cgroup.procs" || { echo "slower_cpu.sh: cannot move into $group (run as root)" >&2; exit 2; }
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
echo "slower_cpu.sh: $cpus CPUs, AVX2 code paths, 2 threads: $*" >&2
exec "$@"
