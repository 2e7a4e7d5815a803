#!/usr/bin/env bash
# Fill .gpu/ (git-ignored) with what scripts/gpu_check.sh needs on a GPU machine that reaches no package index:
# the project's dependencies that a PyTorch GPU image lacks, as CPython 3.12 wheels (jsonargparse with its
# signatures extra, pycocotools), pycocoevalcap's Python files (its Java jars stay behind: METEOR and the PTB
# tokenizer need Java, which such a machine lacks, and the metrics skip them there), and Fashion-MNIST.
#
#     scripts/gpu_check_prepare.sh [RUOTIANLUO]   (on a machine with pip's index and the project's venv; ~35 MB)
#
# RUOTIANLUO, a git directory of ruotianluo/ImageCaptioning.pytorch (a snapshot, bare or not): the few files of
# theirs that benchmarks/peers_gpu.py reads are copied from its HEAD to .gpu/ruotianluo, laid out as a checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/site .gpu/fashion_mnist
for package in jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 pycocotools==2.0.11; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .gpu/wheels "$package"
done
source=$("$PY" -c "import pycocoevalcap; print(list(pycocoevalcap.__path__)[0])")
(cd "$source/.." && find pycocoevalcap -name '*.py' -print0 | xargs -0 -I{} cp --parents {} "$OLDPWD/.gpu/site/")
data=/usr/share/datasets/fashion-mnist
[ -f "$data/train-images-idx3-ubyte.gz" ] || data=data/fashion_mnist
cp "$data"/*-ubyte.gz .gpu/fashion_mnist/
if [ -n "${1:-}" ]; then
    files=$("$PY" -c "from benchmarks.peers import PEER_FILES, PEER_LOSSES; print(' '.join((*PEER_FILES, PEER_LOSSES)))")
    for name in $files; do
        mkdir -p ".gpu/ruotianluo/$(dirname "$name")"
        git --git-dir="$1" show "HEAD:$name" > ".gpu/ruotianluo/$name"
    done
    git --git-dir="$1" rev-parse HEAD > .gpu/ruotianluo/COMMIT
fi
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
