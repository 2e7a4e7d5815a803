#!/usr/bin/env bash
# The GPU check: what this project proves on a GPU, as one script for a bare GPU machine.
#
#     scripts/gpu_check_prepare.sh        (first, on a machine with pip's index: fills .gpu/, ~31 MB)
#     scripts/gpu_check.sh [OUT [PART...]] (on the GPU machine; OUT: where figures and logs go, default gpu_check/;
#                                          PARTs: which to run, default all: machine fit peers compiled_equals_eager
#                                          benchmark rehearsal vit)
#
# The GPU machine needs PyTorch with CUDA, Lightning, timm, torchvision, pytest and pytest-xdist; the project's
# other dependencies come from .gpu/ (scripts/gpu_check_prepare.sh), and nothing is downloaded. Its parts' time
# limits add up to more than one 10-minute command: name the parts, a few per call (`machine fit peers`, then
# `compiled_equals_eager benchmark`, then `rehearsal vit`). It runs:
#   1. the machine: nvidia-smi, the versions of torch, CUDA and Lightning, whether Java is there (METEOR);
#   2. decoder.compile against eager on the GPU (scripts/compiled_decoder_check.py: the same beams and logits at
#      four batch sizes, default and reduce-overhead; OUT/compiled_equals_eager.log), then
#      `vision-attn benchmark --device cuda --compile`: the paper-shape captioner's train step (eager, and compiled
#      in bf16) and beam search, ViT-B/16 against timm, the feature cache's fill rate, in fp32, bf16-mixed and
#      16-mixed, against the GPU's own matmul rate, and a projected COCO epoch (OUT/benchmark.json, .md);
#   3. the COCO rehearsal on the GPU (tests/test_coco_rehearsal.py with VISION_ATTN_TEST_DEVICE=cuda): both COCO
#      configs fit with the feature cache, test, and (VGG-19) evaluate, caption and overlay on the GPU, in
#      bf16-mixed and in 16-mixed (OUT/rehearsal.log, rehearsal.xml);
#   4. the ViT Fashion-MNIST default fitted for 1 minute on the GPU in bf16-mixed, then tested (OUT/vit_*.log);
#   5. fit: a whole `vision-attn fit` of the COCO VGG-19 recipe on COCO-shaped data, eager and compiled
#      (reduce-overhead), fp32 and bf16-mixed (python -m benchmarks.fit_throughput; OUT/fit_throughput.json);
#   6. peers: the train step and beam search beside ruotianluo/ImageCaptioning.pytorch's Att2in2 and UpDown
#      (python -m benchmarks.peers_gpu, their files from .gpu/ruotianluo; OUT/peers_gpu.json).
# OUT/summary.md gathers the figures; each part's exit status is in it. Exit 1 if any part failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check}
shift || true
WANTED=" ${*:-machine fit peers compiled_equals_eager benchmark rehearsal vit} "
mkdir -p "$OUT"
[ -d .gpu/wheels ] || { echo "gpu_check.sh: .gpu/ is missing: run scripts/gpu_check_prepare.sh first" >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
SITE=/tmp/vision_attn_site
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .gpu/wheels/*.whl || exit 1
cp -r .gpu/site/* "$SITE"/
export PYTHONPATH="$SITE:$PWD"
mkdir -p /tmp/vision_attn_bin
printf '#!/usr/bin/env python3\nfrom vision_attn.cli import main\nmain()\n' > /tmp/vision_attn_bin/vision-attn
chmod +x /tmp/vision_attn_bin/vision-attn
export PATH="/tmp/vision_attn_bin:$PATH"
status=0
PARTS=$(mktemp)
part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to OUT/NAME.log, record the exit status
    local name=$1 limit=$2
    shift 2
    [[ "$WANTED" == *" ${name%%_*} "* || "$WANTED" == *" $name "* ]] || return 0
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    echo "| $name | exit $code | $((SECONDS - start)) s |" >> "$PARTS"
    [ $code -eq 0 ] || status=1
    return $code
}
echo "| part | status | time |" > "$PARTS"
echo "| --- | --- | --- |" >> "$PARTS"

part machine 30 bash -c 'nvidia-smi; python3 -c "import torch, lightning, timm, torchvision, jsonargparse; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"lightning\", lightning.__version__, \"timm\", timm.__version__, \"torchvision\", torchvision.__version__, \"jsonargparse\", jsonargparse.__version__); print(torch.cuda.get_device_name(0))"; java -version 2>&1 || echo "no Java: METEOR and the PTB tokenizer are skipped"; nproc; free -g'
part fit 330 python3 -m benchmarks.fit_throughput --epochs 2 --train-images 4160 --out "$OUT/fit_throughput.json" \
    --variants "compiled reduce-overhead bf16-mixed" "eager bf16-mixed" "compiled reduce-overhead 32-true"
PEER=()
[ -d .gpu/ruotianluo ] && PEER=(--ruotianluo .gpu/ruotianluo)
part peers 150 python3 -m benchmarks.peers_gpu "${PEER[@]}" --repeats 5 --out "$OUT/peers_gpu.json"
part compiled_equals_eager 120 python3 scripts/compiled_decoder_check.py --device cuda --modes default reduce-overhead
part benchmark 240 vision-attn benchmark --device cuda --compile --out "$OUT/benchmark.json"
export VISION_ATTN_TEST_DEVICE=cuda
part rehearsal 140 python3 -m pytest -q -p no:cacheprovider -n 4 --durations=0 \
    --junitxml "$OUT/rehearsal.xml" tests/test_coco_rehearsal.py
unset VISION_ATTN_TEST_DEVICE
VIT="--config configs/trainer/gpu.yaml --config configs/tasks/classifier.yaml --config configs/data/fashion_mnist.yaml
     --config configs/vit/fashion_mnist.yaml"
RUN=/tmp/vision_attn_vit
# shellcheck disable=SC2086
part vit_fit 100 vision-attn fit $VIT --trainer.max_time 00:00:01:00 --trainer.default_root_dir "$RUN" \
    --trainer.logger.init_args.save_dir "$RUN" --data.init_args.root .gpu/fashion_mnist --overwrite true \
    --trainer.enable_progress_bar false
# shellcheck disable=SC2086
part vit_test 45 vision-attn test $VIT --ckpt_path "$RUN/checkpoints/best.ckpt" --trainer.default_root_dir "$RUN/test" \
    --trainer.logger false --data.init_args.root .gpu/fashion_mnist --trainer.enable_progress_bar false

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"; echo
    grep -m1 -E "H100|H200|A100|L4|NVIDIA" "$OUT/machine.log" | sed 's/^/    /'; echo
    cat "$PARTS"; echo
    echo "## A whole fit of the COCO recipe"; echo
    sed -n '/^| what/,/^$/p' "$OUT/fit.log" 2>/dev/null
    python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/fit_throughput.json" \
        2>/dev/null | grep -q . && ! grep -q '^| what' "$OUT/fit.log" && \
        python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/fit_throughput.json"
    echo
    echo "## Beside ruotianluo/ImageCaptioning.pytorch"; echo
    sed -n '/^| what/,/^$/p' "$OUT/peers.log" 2>/dev/null; echo
    echo "## Compiled decoder against eager"; echo
    grep -E "ok|WRONG|equals|differs" "$OUT/compiled_equals_eager.log" | sed 's/^/    /'; echo
    echo "## Benchmark"; echo
    sed -n '/^| what/,/^$/p' "$OUT/benchmark.log"; echo
    echo "## COCO rehearsal on the GPU"; echo
    grep -E "passed|failed|error|s call" "$OUT/rehearsal.log" | sed 's/^/    /'; echo
    echo "## ViT Fashion-MNIST default, 1 minute on the GPU"; echo
    grep -E "Epoch|stopped|max_time" "$OUT/vit_fit.log" | tail -3 | sed 's/^/    /'
    grep -E "test/(acc|loss)" "$OUT/vit_test.log" | sed 's/^/    /'
} > "$OUT/summary.md"
cat "$OUT/summary.md"
exit $status
