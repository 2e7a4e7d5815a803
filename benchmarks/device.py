"""Speed on a device: ``vision-attn benchmark --device cuda|cpu``.

At the paper's shape (a frozen VGG-19 at 224 px, batches of 64 captions, D=512, L=196, T=20, 10k words) and for
ViT-B/16 at 224 px against timm's, each in fp32, bf16-mixed and 16-mixed where the device has them:

- the captioner's train step (from the cached annotation vectors, as the feature cache serves them), and with
  ``--compile`` through ``torch.compile`` too (in bf16-mixed where the device has it, else fp32), and its beam
  search;
- the ViT's train and inference steps, ours and timm's with the same weights;
- the feature cache's fill rate: the frozen VGG-19 alone, and from JPEG files to fp16 shards on disk;
- images (or captions) per second, and the achieved TFLOP/s (FLOPs counted by torch's FlopCounterMode over the
  measured time) as a share of the device's own matmul rate, measured in the same run;
- a projected COCO epoch from these figures.

Every time is the median of repeated runs after warm-up, on a GPU between CUDA events. ``--quick`` shrinks every
shape (a smoke test, as CI runs it on a CPU). Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.synthetic import backward_and_step, random_captions
from benchmarks.timing import median_time, median_times

PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
COCO_IMAGES, COCO_CAPTIONS = 113_287, 566_747  # Karpathy train + restval


def precisions(device: torch.device) -> list[str]:
    """The precisions the device computes natively: all three on a CUDA GPU (bf16 where it has it), fp32 on a
    CPU, and bf16 there too when the CPU has bf16 arithmetic (elsewhere it is emulated, tens of times slower)."""
    if device.type == "cuda":
        return ["32-true", *(["bf16-mixed"] if torch.cuda.is_bf16_supported() else []), "16-mixed"]
    from vision_attn.hardware import cpu_flags, has_native_bf16

    return ["32-true", *(["bf16-mixed"] if has_native_bf16(cpu_flags()) else [])]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[precision]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def counted_flops(run: Callable[[], Any]) -> float:
    with FlopCounterMode(display=False) as counter:
        run()
    return float(counter.get_total_flops())


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """The device's own matmul rate for ``dtype`` (fp32 at PyTorch's default precision), on random data."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    return 2 * size**3 / median_time(device, lambda: a @ b, repeats=repeats, warmup=3) / 1e12


def captioner_step(device: torch.device, precision: str, shape: dict[str, int], *, compiled: str | None,
                   repeats: int) -> dict[str, float]:
    """The decoder's train step from cached annotation vectors: teacher forcing, the NLL and the doubly
    stochastic term at the paper's scale (λ = 1), backward, AdamW (with a gradient scaler in 16-mixed);
    ``compiled``: through ``decoder.compile`` in that torch.compile mode, as the option does."""
    from vision_attn.captioning.compiled import compile_decoder
    from vision_attn.captioning.decoder import AttentionDecoder
    from vision_attn.captioning.likelihood import likelihood_objective, token_likelihood

    torch.manual_seed(0)
    width = shape["width"]
    decoder = AttentionDecoder(vocab_size=shape["vocab"], annotation_dim=shape["dim"], embed_dim=width,
                               hidden_dim=width, attention_dim=width, dropout=0.5).to(device).train()
    if compiled:
        compile_decoder(decoder, compiled)
    forward = decoder
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    annotations = torch.randn(shape["batch"], shape["locations"], shape["dim"], device=device)
    captions = random_captions(shape["batch"], shape["length"], shape["vocab"],
                               torch.Generator().manual_seed(0))[0].to(device)

    def step() -> None:
        with autocast(device, precision):
            output = forward(annotations, captions)
            terms = likelihood_objective(token_likelihood(output.logits, captions), output.alphas, 1.0, "paper")
            loss = terms.nll + terms.penalty
        backward_and_step(loss, optimizer, scaler)

    started = time.perf_counter()
    step()  # the first call compiles
    first = time.perf_counter() - started
    seconds = median_time(device, step, repeats=repeats, warmup=2)
    flops = counted_flops(step) if not compiled else float("nan")
    return {"seconds": seconds, "captions_per_s": shape["batch"] / seconds, "flops": flops,
            "tflops_per_s": flops / seconds / 1e12, "first_step_s": first}


@torch.no_grad()
def beam_search_speed(device: torch.device, precision: str, shape: dict[str, int], *, beam_size: int,
                      repeats: int, compiled: str | None = None) -> dict[str, float]:
    """Batched beam search of every image at the paper's shape, T words each; ``compiled``: its step compiled."""
    from vision_attn.captioning.beam_search import beam_search
    from vision_attn.captioning.compiled import compile_decoder
    from vision_attn.captioning.decoder import AttentionDecoder
    from vision_attn.data.vocabulary import END_ID, START_ID

    torch.manual_seed(0)
    width = shape["width"]
    decoder = AttentionDecoder(vocab_size=shape["vocab"], annotation_dim=shape["dim"], embed_dim=width,
                               hidden_dim=width, attention_dim=width).to(device).eval()
    if compiled:
        compile_decoder(decoder, compiled)
    annotations = torch.randn(shape["batch"], shape["locations"], shape["dim"], device=device)

    def search() -> None:
        with autocast(device, precision):
            beam_search(decoder, annotations, start_id=START_ID, end_id=END_ID, beam_size=beam_size,
                        max_length=shape["length"], min_length=shape["length"])  # every image decodes T words

    seconds = median_time(device, search, repeats=repeats, warmup=2 if compiled else 1)
    return {"seconds": seconds, "images_per_s": shape["batch"] / seconds}


def vit_steps(device: torch.device, precision: str, shape: dict[str, int], *, repeats: int) -> dict[str, float]:
    """Train step (AdamW) and inference of our ViT and timm's, the same config and weights, images/s; the two
    models' timed calls alternate (``median_times``)."""
    import timm.models.vision_transformer as timm_vit

    from vision_attn.vit.vision_transformer import VisionTransformer

    config = dict(img_size=shape["image"], patch_size=shape["patch"], in_chans=3, num_classes=1000,
                  embed_dim=shape["dim"], depth=shape["depth"], num_heads=shape["heads"])
    torch.manual_seed(0)
    ours = VisionTransformer(**config).to(device)
    theirs = timm_vit.VisionTransformer(**config).to(device)
    theirs.load_state_dict(ours.state_dict())
    images = torch.randn(shape["batch"], 3, shape["image"], shape["image"], device=device)
    labels = torch.randint(0, 1000, (shape["batch"],), device=device)
    trains, infers = {}, {}
    for name, model in (("ours", ours), ("timm", theirs)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

        def train(model: torch.nn.Module = model, optimizer: torch.optim.Optimizer = optimizer,
                  scaler: torch.amp.GradScaler | None = scaler) -> None:
            with autocast(device, precision):
                loss = torch.nn.functional.cross_entropy(model.train()(images), labels)
            backward_and_step(loss, optimizer, scaler)

        def infer(model: torch.nn.Module = model) -> None:
            with torch.inference_mode(), autocast(device, precision):
                model.eval()(images)

        trains[name], infers[name] = train, infer
    train_s = median_times(device, trains, repeats=repeats, warmup=2)
    infer_s = median_times(device, infers, repeats=repeats, warmup=2)
    measured: dict[str, float] = {}
    for name in ("ours", "timm"):
        measured[f"{name}_train_images_per_s"] = shape["batch"] / train_s[name]
        measured[f"{name}_inference_images_per_s"] = shape["batch"] / infer_s[name]
    measured["train_tflops_per_s"] = counted_flops(trains["ours"]) / train_s["ours"] / 1e12
    measured["inference_tflops_per_s"] = counted_flops(infers["ours"]) / infer_s["ours"] / 1e12
    measured["train_ratio"] = measured["ours_train_images_per_s"] / measured["timm_train_images_per_s"]
    measured["inference_ratio"] = measured["ours_inference_images_per_s"] / measured["timm_inference_images_per_s"]
    return measured


def write_jpegs(folder: Path, count: int, size: tuple[int, int]) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        pixels = rng.integers(0, 255, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
        path = folder / f"{index}.jpg"
        Image.fromarray(pixels).resize(size, Image.Resampling.BILINEAR).save(path, quality=90)
        paths.append(path)
    return paths


def feature_cache_fill(device: torch.device, precision: str, shape: dict[str, int], *,
                       repeats: int) -> dict[str, float]:
    """The frozen VGG-19 (to conv5_4) alone, and a whole fill: JPEG decode and resize, the encoder, fp16 shards
    written to disk (``data.feature_cache``), images/s."""
    from vision_attn.captioning.encoder import AnnotationEncoder
    from vision_attn.data.coco import load_caption_image
    from vision_attn.data.feature_cache import FeatureCache
    from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD, normalize

    encoder = AnnotationEncoder(backbone="vgg19", trainable_stages=0, channels_last=device.type == "cuda")
    frozen = encoder.frozen_part().to(device).eval()
    size, batch = shape["image"], shape["batch"]
    images = torch.rand(batch, 3, size, size, device=device)

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), autocast(device, precision):
            return frozen(pixels)

    encoder_s = median_time(device, lambda: encode(images), repeats=repeats, warmup=2)
    result = {"encoder_images_per_s": batch / encoder_s,
              "encoder_tflops_per_s": counted_flops(lambda: encode(images)) / encoder_s / 1e12}
    with tempfile.TemporaryDirectory() as folder:
        count = shape["fill_images"]
        paths = write_jpegs(Path(folder), count, (640, 480) if size >= 128 else (size * 2, size * 2))
        output = encode(images[:1])
        cache = FeatureCache(Path(folder) / "cache", {"benchmark": precision}, count, tuple(output.shape[1:]),
                             shard_size=batch)
        started = time.perf_counter()
        cache.fill(lambda i: load_caption_image(paths[i], size),
                   lambda pixels: encode(normalize(pixels.to(device), IMAGENET_MEAN, IMAGENET_STD)).float(),
                   batch_size=batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["fill_images_per_s"] = count / (time.perf_counter() - started)
    return result


SHAPES = {  # the paper's captioner, ViT-B/16; --quick: small enough for CI on a CPU
    "full": {"captioner": {"batch": 64, "locations": 196, "dim": 512, "width": 512, "length": 20, "vocab": 10000},
             "beam": {"batch": 64, "locations": 196, "dim": 512, "width": 512, "length": 20, "vocab": 10000},
             "vit": {"batch": 64, "image": 224, "patch": 16, "dim": 768, "depth": 12, "heads": 12},
             "vgg": {"batch": 64, "image": 224, "fill_images": 256}, "matmul": 8192, "repeats": 10},
    "quick": {"captioner": {"batch": 4, "locations": 16, "dim": 32, "width": 32, "length": 5, "vocab": 100},
              "beam": {"batch": 4, "locations": 16, "dim": 32, "width": 32, "length": 5, "vocab": 100},
              "vit": {"batch": 2, "image": 32, "patch": 8, "dim": 64, "depth": 2, "heads": 2},
              "vgg": {"batch": 2, "image": 64, "fill_images": 4}, "matmul": 256, "repeats": 2},
}


COMPILE_MODES = ("default", "reduce-overhead")  # what `--compile` times: fused kernels, and CUDA graphs on a GPU
SECTIONS = ("captioner", "vit", "feature-cache")


def run(device_name: str, *, quick: bool, compile_decoder: bool,
        sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    device = torch.device(device_name)
    shapes = SHAPES["quick" if quick else "full"]
    repeats = shapes["repeats"]
    names = precisions(device)
    results: dict[str, Any] = {"machine": machine(device), "precisions": names, "shapes": shapes, "quick": quick}
    peaks = {name: matmul_tflops(device, PRECISIONS[name] or torch.float32, shapes["matmul"], repeats)
             for name in names}
    results["matmul_tflops"] = peaks
    progress("matmul_tflops", peaks)
    results["captioner_train_step"], results["beam_search"] = {}, {}
    results["vit"], results["feature_cache"] = {}, {}
    compile_in = "bf16-mixed" if "bf16-mixed" in names else "32-true"  # compiling takes a minute: the likeliest one
    modes = COMPILE_MODES if device.type == "cuda" else COMPILE_MODES[:1]  # CUDA graphs need a GPU
    if "captioner" in sections:
        for name in names:
            results["captioner_train_step"][name] = captioner_step(device, name, shapes["captioner"], compiled=None,
                                                                   repeats=repeats)
            for mode in modes if compile_decoder and name == compile_in else ():
                eager = results["captioner_train_step"][name]
                results["captioner_train_step"][f"{name} compiled {mode}"] = _compiled(
                    lambda mode=mode, name=name: captioner_step(device, name, shapes["captioner"], compiled=mode,
                                                                repeats=repeats), eager, flops=eager["flops"])
        progress("captioner_train_step", results["captioner_train_step"])
        for name in names:
            for k in (3, 5):
                eager = results["beam_search"][f"{name} k={k}"] = beam_search_speed(
                    device, name, shapes["beam"], beam_size=k, repeats=repeats)
                for mode in modes if compile_decoder and name == compile_in and k == 3 else ():
                    results["beam_search"][f"{name} k={k} compiled {mode}"] = _compiled(
                        lambda mode=mode, name=name, k=k: beam_search_speed(device, name, shapes["beam"], beam_size=k,
                                                                            repeats=repeats, compiled=mode), eager)
        progress("beam_search", results["beam_search"])
    if "vit" in sections:
        results["vit"] = {name: vit_steps(device, name, shapes["vit"], repeats=repeats) for name in names}
        progress("vit", results["vit"])
    if "feature-cache" in sections:
        results["feature_cache"] = {name: feature_cache_fill(device, name, shapes["vgg"], repeats=repeats)
                                    for name in names}
        progress("feature_cache", results["feature_cache"])
    results["coco_epoch"] = coco_epoch(results, shapes) if set(SECTIONS) <= set(sections) else {}
    results["table"] = table(results)
    return results


def _compiled(measure: Callable[[], dict[str, float]], eager: dict[str, float], *,
              flops: float | None = None) -> dict[str, Any]:
    """A compiled variant's figures with its speed-up over ``eager`` (a compiler that cannot run here: a row
    saying why, not a crash)."""
    try:
        figures = measure()
    except Exception as error:  # noqa: BLE001
        return {"error": str(error).splitlines()[0][:300]}
    figures["speedup"] = eager["seconds"] / figures["seconds"]
    if flops is not None:
        figures.update(flops=flops, tflops_per_s=flops / figures["seconds"] / 1e12)
    return figures


def progress(section: str, figures: dict[str, Any]) -> None:
    """One line per finished section, so that a run stopped at a time limit still leaves what it measured."""
    print(f"{section}: {json.dumps(figures, default=str)}", flush=True)


def cpu_description() -> str:
    """The CPU as ``lscpu`` names it, with its family and model and the vector flags that change our figures
    (AVX2, AVX-512, bf16, AMX); the architecture alone where /proc/cpuinfo is not there."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    except OSError:
        return platform.processor() or platform.machine()
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
             if flag in fields.get("flags", "").split()]
    return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {' '.join(flags) or 'no AVX2'})")


def machine(device: torch.device) -> dict[str, Any]:
    """The device, torch, the CPU (``cpu_description``), the date, and for CUDA the card."""
    found = {"device": str(device), "torch": torch.__version__, "cpu": cpu_description(),
             "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        found.update(gpu=properties.name, gpu_memory_gb=round(properties.total_memory / 1e9, 1),
                     multiprocessors=properties.multi_processor_count, cuda=torch.version.cuda)
    return found


def coco_epoch(results: dict[str, Any], shapes: dict[str, Any]) -> dict[str, float]:
    """One Karpathy COCO epoch from the measured figures: the best captioner step over every caption, and the
    frozen encoder once per image (the cache fill, or the encoder in every epoch without a cache)."""
    steps = math.ceil(COCO_CAPTIONS / shapes["captioner"]["batch"])
    step = min(entry["seconds"] for entry in results["captioner_train_step"].values() if "seconds" in entry)
    fill = max(entry["fill_images_per_s"] for entry in results["feature_cache"].values())
    encoder = max(entry["encoder_images_per_s"] for entry in results["feature_cache"].values())
    return {"decoder_minutes": steps * step / 60, "cache_fill_minutes": COCO_IMAGES / fill / 60,
            "encoder_minutes_per_epoch_uncached": COCO_IMAGES / encoder / 60,
            "epoch_minutes_cached": steps * step / 60,
            "epoch_minutes_uncached_grouped": steps * step / 60 + COCO_IMAGES / encoder / 60}


def table(results: dict[str, Any]) -> str:
    peaks, shapes = results["matmul_tflops"], results["shapes"]
    caption, vit = shapes["captioner"], shapes["vit"]
    vit_name = "ViT-B/16" if vit["dim"] == 768 and vit["depth"] == 12 else \
        f"ViT ({vit['image']} px, patch {vit['patch']}, D={vit['dim']}, depth {vit['depth']})"
    rows = [("device", f"{results['machine'].get('gpu', results['machine']['cpu'])} (torch "
                       f"{results['machine']['torch']})"),
            ("captioner shape", f"batch {caption['batch']} captions, L={caption['locations']}, D={caption['dim']}, "
                                f"widths {caption['width']}, T={caption['length']}, {caption['vocab']} words")]
    rows += [(f"matmul rate, {name}", f"{peak:.1f} TFLOP/s") for name, peak in peaks.items()]
    for key, entry in results["captioner_train_step"].items():
        if "error" in entry:
            rows.append((f"captioner train step, {key}", f"not run: {entry['error']}"))
            continue
        precision = key.split()[0]
        share = f", {entry['tflops_per_s'] / peaks[precision]:.0%} of the matmul rate" \
            if not math.isnan(entry["tflops_per_s"]) else ""
        speedup = f", {entry['speedup']:.2f}× eager" if "speedup" in entry else ""
        rows.append((f"captioner train step, {key}", f"{entry['captions_per_s']:.0f} captions/s "
                     f"({entry['seconds'] * 1000:.1f} ms/step{share}{speedup}; first step "
                     f"{entry['first_step_s']:.1f} s)"))
    for key, entry in results["beam_search"].items():
        if "error" in entry:
            rows.append((f"beam search, {key}", f"not run: {entry['error']}"))
            continue
        speedup = f" ({entry['speedup']:.2f}× eager)" if "speedup" in entry else ""
        rows.append((f"beam search, {key}", f"{entry['images_per_s']:.0f} images/s{speedup}"))
    for key, entry in results["vit"].items():
        rows.append((f"{vit_name} train step (batch {vit['batch']}), {key}: ours vs timm",
                     f"{entry['ours_train_images_per_s']:.0f} vs {entry['timm_train_images_per_s']:.0f} img/s "
                     f"(ratio {entry['train_ratio']:.2f}; ours {entry['train_tflops_per_s'] / peaks[key]:.0%} of the "
                     "matmul rate)"))
        rows.append((f"{vit_name} inference, {key}: ours vs timm", f"{entry['ours_inference_images_per_s']:.0f} vs "
                     f"{entry['timm_inference_images_per_s']:.0f} img/s (ratio {entry['inference_ratio']:.2f})"))
    for key, entry in results["feature_cache"].items():
        rows.append((f"feature cache, {key}: VGG-19 conv5_4 alone / a whole fill from JPEGs ({shapes['vgg']['image']} "
                     f"px, batch {shapes['vgg']['batch']})",
                     f"{entry['encoder_images_per_s']:.0f} / {entry['fill_images_per_s']:.0f} img/s"))
    epoch = results["coco_epoch"]
    if not results["quick"] and epoch:
        rows.append(("projected COCO epoch (Karpathy train + restval): cached / uncached with grouped captions",
                     f"{epoch['epoch_minutes_cached']:.1f} / {epoch['epoch_minutes_uncached_grouped']:.1f} min "
                     f"(+ {epoch['cache_fill_minutes']:.1f} min to fill the cache once)"))
    lines = ["| what | measured |", "| --- | --- |", *(f"| {what} | {figure} |" for what, figure in rows)]
    return "\n".join(lines)
