"""Measured speed, side by side: ``vision-attn benchmark`` (also ``python -m benchmarks.run``) in a checkout.

Every figure is the median of repeated runs after warm-up; every comparison is a ratio measured in the same
process. Prints a markdown table and writes JSON. ``--quick`` shrinks sizes for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import string
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from benchmarks.device import run as run_on_device
from benchmarks.reference_decoder import TutorialStyleDecoder
from benchmarks.synthetic import random_captions
from benchmarks.timing import median_seconds, paired_median_seconds
from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.likelihood import token_likelihood
from vision_attn.cli_arguments import OneLineParser, bounded_int, device, number_in
from vision_attn.data.vocabulary import END_ID, START_ID, Vocabulary
from vision_attn.errors import exit_on_user_error
from vision_attn.io import output_file, replace_atomically


def decoder_train_step(decoder: AttentionDecoder, optimizer: torch.optim.Optimizer, annotations: Tensor,
                        captions: Tensor) -> None:
    """Teacher-forced loss on the real tokens, backward, optimiser step: our decoder's train step."""
    loss = token_likelihood(decoder(annotations, captions).logits, captions).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def captioner_train_step(*, annotation_dim: int, locations: int, length: int, batch: int = 32,
                         vocab_size: int = 10000, width: int = 512, repeats: int = 3) -> dict[str, float]:
    """Decoder train-step time, ours against the tutorial-style reference, same dims, same process."""
    generator = torch.Generator().manual_seed(0)
    annotations = torch.randn(batch, locations, annotation_dim, generator=generator)
    captions, lengths = random_captions(batch, length, vocab_size, generator)
    dims = dict(vocab_size=vocab_size, annotation_dim=annotation_dim, embed_dim=width, hidden_dim=width,
                attention_dim=width)
    ours, reference = AttentionDecoder(**dims), TutorialStyleDecoder(**dims)
    ours_optimizer = torch.optim.Adam(ours.parameters(), lr=1e-4)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-4)

    def ours_step() -> None:
        decoder_train_step(ours, ours_optimizer, annotations, captions)

    def reference_step() -> None:
        predictions, sorted_captions, decode_lengths = reference(annotations, captions, lengths)
        targets = sorted_captions[:, 1:]
        packed = nn.utils.rnn.pack_padded_sequence(predictions, decode_lengths, batch_first=True).data
        packed_targets = nn.utils.rnn.pack_padded_sequence(targets, decode_lengths, batch_first=True).data
        loss = F.cross_entropy(packed, packed_targets)
        reference_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reference_optimizer.step()

    timed = paired_median_seconds({"ours": ours_step, "reference": reference_step}, repeats=repeats, warmup=1)
    ours_time, reference_time = timed["ours"], timed["reference"]
    return {"ours_s": ours_time, "reference_s": reference_time, "ours_images_per_s": batch / ours_time,
            "reference_images_per_s": batch / reference_time, "speedup": reference_time / ours_time}


@torch.no_grad()
def beam_search_speed(*, beam_size: int, batch: int = 64, vocab_size: int = 10000, annotation_dim: int = 512,
                      locations: int = 196, width: int = 512, max_length: int = 20) -> dict[str, float]:
    """Images/s of the batched beam search against decoding the same images one at a time.

    The decoder is untrained, so where its beams would stop is random: an image decoded alone may stop
    after 2 words while a batch runs on as long as one of its images does. Both therefore decode exactly
    ``max_length`` words (``min_length = max_length``): the same steps, the same model, the same code.
    With that, every image costs the same alone, so the one-at-a-time rate is timed on the first 16.
    """
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=vocab_size, annotation_dim=annotation_dim, embed_dim=width,
                               hidden_dim=width, attention_dim=width).eval()
    annotations = torch.randn(batch, locations, annotation_dim)
    search = dict(start_id=START_ID, end_id=END_ID, beam_size=beam_size, max_length=max_length,
                  min_length=max_length)
    batched = median_seconds(lambda: beam_search(decoder, annotations, **search), repeats=3, warmup=1)
    alone = min(batch, 16)
    one_by_one = median_seconds(lambda: [beam_search(decoder, annotations[i : i + 1], **search)
                                         for i in range(alone)], repeats=3, warmup=1)
    batched_rate, single_rate = batch / batched, alone / one_by_one
    return {"batched_images_per_s": batched_rate, "single_images_per_s": single_rate,
            "speedup": batched_rate / single_rate}


def vocabulary_speed(captions: int = 616_000, seed: int = 0) -> dict[str, float]:
    """Build the vocabulary from and encode ``captions`` generated COCO-sized captions (~10 words)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(12000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]  # Zipf-like, as in real captions
    texts = [" ".join(rng.choices(words, weights, k=rng.randint(8, 14))).capitalize() + "."
             for _ in range(captions)]
    start = time.perf_counter()
    vocabulary = Vocabulary.build(texts, min_count=5)
    built = time.perf_counter()
    vocabulary.encode_batch(texts, 20)
    done = time.perf_counter()
    return {"captions": float(captions), "build_s": built - start, "encode_s": done - built,
            "total_s": done - start, "vocab_size": float(len(vocabulary))}


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: Tensor, labels: Tensor) -> None:
    loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


REPO = Path(__file__).resolve().parents[1]
VIT_DEFAULT_CONFIG = "configs/vit/fashion_mnist.yaml"


def fashion_mnist_default_shape() -> dict[str, Any]:
    """The ViT of ``configs/vit/fashion_mnist.yaml`` (28×28 grey, 10 classes), read from the config itself, so
    the benchmark's "Fashion-MNIST default" rows measure the shipped default."""
    init_args = yaml.safe_load((REPO / VIT_DEFAULT_CONFIG).read_text())["model"]["init_args"]
    architecture, training = init_args["architecture"], init_args["training"]
    shape = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "global_pool")
    return dict(img_size=28, in_chans=1, num_classes=10, **{key: architecture[key] for key in shape},
                patch_drop_rate=training["patch_drop_rate"])


def vit_vs_timm(*, img_size: int, patch_size: int, in_chans: int, num_classes: int, embed_dim: int, depth: int,
                num_heads: int, mlp_ratio: float, global_pool: str, batch: int, repeats: int,
                patch_drop_rate: float = 0.0) -> dict[str, float]:
    """Train-step and inference images/s of our ViT and timm's with the same config and the same weights,
    and the cost of asking ours for its attention maps. ``ours_unfused`` is ours with
    ``fused_attention=False`` (the explicit Softmax(QKᵀ/√d)V instead of the SDPA kernel)."""
    import timm.models.vision_transformer as timm_vit

    from vision_attn.vit.vision_transformer import VisionTransformer

    config = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes,
                  embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, global_pool=global_pool,
                  patch_drop_rate=patch_drop_rate)
    torch.manual_seed(0)
    ours = VisionTransformer(**config)  # type: ignore[arg-type]
    theirs = timm_vit.VisionTransformer(**config)  # type: ignore[arg-type]
    theirs.load_state_dict(ours.state_dict())
    images = torch.randn(batch, in_chans, img_size, img_size)
    labels = torch.randint(0, num_classes, (batch,))
    measured: dict[str, float] = {}
    unfused = VisionTransformer(**config, fused_attention=False)  # type: ignore[arg-type]
    unfused.load_state_dict(ours.state_dict())
    steps = {}
    for name, model in (("ours", ours), ("timm", theirs), ("ours_unfused", unfused)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[name] = lambda m=model, o=optimizer: _train_step(m.train(), o, images, labels)
    for name, seconds in paired_median_seconds(steps, repeats=repeats).items():
        measured[f"{name}_train_images_per_s"] = batch / seconds
    ours.eval()
    theirs.eval()
    with torch.inference_mode():
        timed = paired_median_seconds({"ours": lambda: ours(images), "timm": lambda: theirs(images),
                                       "ours_maps": lambda: ours.forward_with_attention(images)}, repeats=repeats)
    for name in ("ours", "timm"):
        measured[f"{name}_inference_images_per_s"] = batch / timed[name]
    plain, with_maps = timed["ours"], timed["ours_maps"]
    measured["train_ratio"] = measured["ours_train_images_per_s"] / measured["timm_train_images_per_s"]
    measured["unfused_train_ratio"] = measured["ours_unfused_train_images_per_s"] / measured["timm_train_images_per_s"]
    measured["inference_ratio"] = measured["ours_inference_images_per_s"] / measured["timm_inference_images_per_s"]
    measured["attention_maps_time_ratio"] = with_maps / plain
    return measured


VIT_FLOPS_FORMULA = ("FLOPs = 2·N·P²·C·D (patch embedding) + depth·(24·N·D² + 4·N²·D) (qkv 6ND², proj 2ND², "
                     "MLP 16ND², QKᵀ and αV 4N²D) + 2·D·classes, with N = tokens, P = patch, C = channels")


def vit_forward_flops(*, img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int,
                      num_classes: int, mlp_ratio: float = 4.0) -> float:
    """Multiply-adds counted as 2 FLOPs, for one image (see ``VIT_FLOPS_FORMULA``; MLP ratio 4)."""
    patches = (img_size // patch_size) ** 2
    tokens = patches + 1
    dim = embed_dim
    embedding = 2 * patches * patch_size**2 * in_chans * dim
    block = 2 * tokens * dim * 3 * dim + 2 * tokens * dim * dim + 2 * 2 * tokens * dim * dim * mlp_ratio \
        + 4 * tokens**2 * dim
    return embedding + depth * block + 2 * dim * num_classes


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """The CPU's fp32 matmul rate in this process: the peak the ViT's utilisation is measured against."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / median_seconds(lambda: a @ b, repeats=repeats) / 1e9


def captioner_step_time(*, annotation_dim: int, locations: int, length: int, batch: int, vocab_size: int,
                        width: int, repeats: int, encoder: str | None = None, image_size: int = 224) -> float:
    """Seconds per train step of our decoder (and, with ``encoder``, the CNN trunk fine-tuned with it)."""
    from vision_attn.captioning.encoder import AnnotationEncoder

    generator = torch.Generator().manual_seed(0)
    trunk = AnnotationEncoder(backbone=encoder) if encoder else None
    dim = trunk.annotation_dim if trunk else annotation_dim
    decoder = AttentionDecoder(vocab_size=vocab_size, annotation_dim=dim, embed_dim=width, hidden_dim=width,
                               attention_dim=width)
    parameters = list(decoder.parameters()) + (list(trunk.parameters()) if trunk else [])
    optimizer = torch.optim.Adam(parameters, lr=1e-4)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    annotations = torch.randn(batch, locations, annotation_dim, generator=generator)
    captions, _ = random_captions(batch, length, vocab_size, generator)

    def step() -> None:
        decoder_train_step(decoder, optimizer, trunk(images)[0] if trunk else annotations, captions)

    return median_seconds(step, repeats=repeats, warmup=1)


def write_photos(folder: Path, count: int, *, width: int = 640, height: int = 480, seed: int = 0) -> list[Path]:
    """``count`` JPEG photos of smooth noise (photo-like for the codec), landscape and portrait alternating."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    paths = []
    for index in range(count):
        w, h = (width, height) if index % 2 == 0 else (height, width)
        noise = torch.randint(0, 256, (h // 8, w // 8, 3), generator=generator, dtype=torch.uint8)
        paths.append(folder / f"{index}.jpg")
        Image.fromarray(noise.numpy()).resize((w, h), Image.Resampling.BILINEAR).save(paths[-1], quality=90)
    return paths


def feature_cache_speed(*, batch: int = 64, image_size: int = 224, length: int = 20, vocab_size: int = 10000,
                        width: int = 512, repeats: int = 3, gpu_tflops: float = 100.0) -> dict[str, Any]:
    """The paper's setting (VGG-19 to conv5_4, frozen; D=512, L=196; T=20 words, 10k words, batch 64): a train
    step from JPEG files (decode, resize, encoder, decoder) against one from the feature cache, same process,
    in turns; the cache's size per image on disk; FLOPs per image counted by torch; a COCO epoch projected."""
    import tempfile

    from torch.utils.flop_counter import FlopCounterMode

    from vision_attn.captioning.encoder import AnnotationEncoder
    from vision_attn.data.coco import load_caption_image
    from vision_attn.data.feature_cache import FeatureCache
    from vision_attn.data.images import IMAGENET_MEAN, IMAGENET_STD, normalize

    generator = torch.Generator().manual_seed(0)
    encoder = AnnotationEncoder(backbone="vgg19", trainable_stages=0).eval()
    frozen = encoder.frozen_part()
    decoder = AttentionDecoder(vocab_size=vocab_size, annotation_dim=encoder.annotation_dim, embed_dim=width,
                               hidden_dim=width, attention_dim=width)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-4)
    captions, _ = random_captions(batch, length, vocab_size, generator)

    def pixels(paths: list[Path]) -> Tensor:
        return normalize(torch.stack([load_caption_image(p, image_size) for p in paths]), IMAGENET_MEAN, IMAGENET_STD)

    with tempfile.TemporaryDirectory() as folder:
        paths = write_photos(Path(folder), batch)
        with torch.no_grad():
            shape = tuple(frozen(torch.zeros(1, 3, image_size, image_size)).shape[1:])
        cache = FeatureCache(Path(folder) / "cache", {"benchmark": True}, batch, shape, shard_size=batch)
        start = time.perf_counter()
        with torch.no_grad():
            cache.fill(lambda i: load_caption_image(paths[i], image_size),
                       lambda images: frozen(normalize(images, IMAGENET_MEAN, IMAGENET_STD)), batch_size=batch)
        fill_seconds = time.perf_counter() - start
        disk_bytes = sum(path.stat().st_size for path in cache.folder.glob("shard_*"))

        def uncached() -> None:
            with torch.no_grad():
                annotations, _ = encoder(pixels(paths))
            decoder_train_step(decoder, optimizer, annotations, captions)

        def cached() -> None:
            features = torch.stack([cache[i] for i in range(batch)])  # memory-mapped fp16 shards
            annotations, _ = encoder.from_frozen(features)
            decoder_train_step(decoder, optimizer, annotations, captions)

        times = paired_median_seconds({"uncached": uncached, "cached": cached}, repeats=repeats, warmup=1)
        with FlopCounterMode(display=False) as counter:
            with torch.no_grad():
                encoder(pixels(paths[:1]))
        encoder_flops = counter.get_total_flops()
        one_image, _ = encoder.from_frozen(torch.stack([cache[0]]))  # (1, L, D)
        with FlopCounterMode(display=False) as counter:
            decoder_train_step(decoder, optimizer, one_image, captions[:1])
        decoder_flops = counter.get_total_flops()
    coco_images, coco_captions = 113_287, 566_747  # Karpathy train + restval
    steps = coco_captions / batch
    return {
        "batch": batch, "image_size": image_size, "T": length, "vocab": vocab_size, "shape": list(shape),
        "uncached_s_per_step": times["uncached"], "cached_s_per_step": times["cached"],
        "uncached_images_per_s": batch / times["uncached"], "cached_images_per_s": batch / times["cached"],
        "speedup": times["uncached"] / times["cached"], "fill_images_per_s": batch / fill_seconds,
        "disk_bytes_per_image": disk_bytes / batch,
        "encoder_gflops_per_image": encoder_flops / 1e9, "decoder_train_gflops_per_caption": decoder_flops / 1e9,
        "coco_epoch_hours_uncached": steps * times["uncached"] / 3600,
        "coco_epoch_hours_cached": steps * times["cached"] / 3600,
        "coco_cache_fill_hours": coco_images / (batch / fill_seconds) / 3600,
        # group_captions without a cache: each image decoded and encoded once per epoch, every caption decoded
        "coco_epoch_hours_grouped_uncached": (coco_images * fill_seconds / batch + steps * times["cached"]) / 3600,
        "coco_cache_gb": coco_images * disk_bytes / batch / 1e9,
        "gpu_tflops": gpu_tflops,
        "gpu_epoch_minutes_uncached": (coco_captions * (encoder_flops + decoder_flops)) / (gpu_tflops * 1e12) / 60,
        "gpu_epoch_minutes_cached": (coco_captions * decoder_flops + coco_images * encoder_flops)
        / (gpu_tflops * 1e12) / 60,
    }


def growth(times: dict[int, float]) -> str:
    """How time grows with a size: the exponent of the log-log fit between the smallest and largest size."""
    import math

    sizes = sorted(times)
    exponent = math.log(times[sizes[-1]] / times[sizes[0]]) / math.log(sizes[-1] / sizes[0])
    shape = "linear" if 0.8 <= exponent <= 1.2 else ("sub-linear" if exponent < 0.8 else "super-linear")
    return f"{shape} (time ∝ size^{exponent:.2f})"


def image_decode_speed(*, count: int, width: int = 640, height: int = 480, image_size: int = 224) -> dict[str, float]:
    """Images/s on one core of the captioning DataModule's own decode + resize, on generated JPEG photos."""
    import tempfile

    from PIL import Image

    from vision_attn.data.coco import load_caption_image

    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for index in range(count):
            noise = torch.randint(0, 256, (height // 8, width // 8, 3), generator=generator, dtype=torch.uint8)
            image = Image.fromarray(noise.numpy()).resize((width, height), Image.Resampling.BILINEAR)
            paths.append(Path(folder) / f"{index}.jpg")
            image.save(paths[-1], quality=90)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            seconds = median_seconds(lambda: [load_caption_image(p, image_size) for p in paths], repeats=3, warmup=1)
        finally:
            torch.set_num_threads(threads)
    return {"images": float(count), "images_per_s_per_core": count / seconds, "source": f"{width}x{height} JPEG",
            "to": float(image_size)}


def scenes_speed(*, count: int) -> dict[str, float]:
    """Fashion scenes generated per second (images, captions and annotation files written)."""
    import tempfile

    from vision_attn.data.scenes import make_scenes

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        make_scenes(folder, counts={"train": count, "val": count // 10, "test": count // 10}, seed=0)
        seconds = time.perf_counter() - start
    total = count + 2 * (count // 10)
    return {"scenes": float(total), "seconds": seconds, "scenes_per_s": total / seconds}


def time_to_quality(which: str) -> dict[str, Any]:
    """Run the README's fit + test commands for ``which`` ("vit" or "captioner") and read the test metrics."""
    import re
    import subprocess
    import sys

    configs, run = {
        "vit": (("configs/trainer/cpu.yaml", "configs/tasks/classifier.yaml", "configs/data/fashion_mnist.yaml",
                 VIT_DEFAULT_CONFIG), "runs/vit_fashion_mnist"),
        "captioner": (("configs/trainer/cpu.yaml", "configs/tasks/captioner.yaml",
                       "configs/captioner/fashion_scenes.yaml"), "runs/captioner_fashion_scenes")}[which]
    config = [arg for name in configs for arg in ("--config", name)]
    command = [sys.executable, "-m", "vision_attn.cli"]
    start = time.perf_counter()
    subprocess.run([*command, "fit", *config], check=True)
    fit_seconds = time.perf_counter() - start
    tested = subprocess.run([*command, "test", *config, "--ckpt_path", f"{run}/checkpoints/best.ckpt"],
                            check=True, capture_output=True, text=True)
    metrics = dict(re.findall(r"^[\s│|]*(test/[\w\-]+)[\s│|]+([-\d.e+]+)[\s│|]*$", tested.stdout, flags=re.MULTILINE))
    return {"config": " ".join(config), "fit_wall_s": fit_seconds, "metrics": {k: float(v) for k, v in metrics.items()}}


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| what | figure | goal |", "| --- | --- | --- |"]
    lines += [f"| {what} | {figure} | {goal} |" for what, figure, goal in rows]
    return "\n".join(lines)


def feature_cache_rows(options: argparse.Namespace, results: dict[str, Any], rows: list[tuple[str, str, str]]) -> None:
    """The feature cache at the paper's setting: its rows and results."""
    quick = options.quick
    if quick:
        cache = feature_cache_speed(batch=4, image_size=64, length=5, vocab_size=1000, width=64, repeats=1,
                                    gpu_tflops=options.gpu_tflops)
    else:
        cache = feature_cache_speed(repeats=3, gpu_tflops=options.gpu_tflops)
    results["feature_cache"] = cache
    setting = (f"VGG-19 conv5_4 frozen, {cache['image_size']} px, batch {cache['batch']}, D=512, "
               f"L={cache['shape'][-1] * cache['shape'][-2]}, T={cache['T']}, {cache['vocab']} words")
    rows.append((f"captioner train step from JPEGs vs from the feature cache ({setting})",
                 f"{cache['uncached_images_per_s']:.1f} vs {cache['cached_images_per_s']:.1f} img/s "
                 f"({cache['speedup']:.1f}×)", "≥ 5×"))
    rows.append(("feature cache on disk per image (fp16 shards)", f"{cache['disk_bytes_per_image'] / 1000:.1f} KB",
                 "≤ 210 KB"))
    rows.append(("FLOPs per image (torch's FlopCounterMode): encoder forward / decoder train step per caption",
                 f"{cache['encoder_gflops_per_image']:.1f} / {cache['decoder_train_gflops_per_caption']:.2f} GFLOP",
                 "report"))
    rows.append(("projection, one COCO epoch (566,747 captions in batches of the size above) on this CPU: "
                 "uncached / uncached with group_captions / cached (+ filling the cache once)",
                 f"{cache['coco_epoch_hours_uncached']:.0f} h / {cache['coco_epoch_hours_grouped_uncached']:.0f} h / "
                 f"{cache['coco_epoch_hours_cached']:.0f} h (+ {cache['coco_cache_fill_hours']:.0f} h, "
                 f"{cache['coco_cache_gb']:.1f} GB)", "projection"))
    rows.append((f"projection, one COCO epoch on a GPU sustaining {cache['gpu_tflops']:.0f} TFLOP/s: uncached / "
                 "cached (FLOPs only, no input pipeline)",
                 f"{cache['gpu_epoch_minutes_uncached']:.0f} min / {cache['gpu_epoch_minutes_cached']:.0f} min",
                 "projection"))


def run(options: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(options.threads or torch.get_num_threads())
    quick = options.quick
    results: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                           "threads": torch.get_num_threads(), "torch": torch.__version__,
                                           "date": time.strftime("%Y-%m-%d")}}
    rows: list[tuple[str, str, str]] = []
    if options.only == "feature-cache":
        feature_cache_rows(options, results, rows)
        results["table"] = markdown_table(rows)
        return results
    repeats = 2 if quick else 7  # ratios of equal work wander by several % on a shared machine: take more turns

    # 1. ViT against timm, same config and weights
    vit_configs = {
        "ViT-Tiny/16 at 224": dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=192,
                                   depth=12, num_heads=3, mlp_ratio=4.0, global_pool="token",
                                   batch=4 if quick else 32),
        "Fashion-MNIST default": dict(fashion_mnist_default_shape(), batch=16 if quick else 256),
    }
    if quick:
        vit_configs["ViT-Tiny/16 at 224"].update(img_size=32, depth=2)
    results["vit_vs_timm"] = {}
    for name, config in vit_configs.items():
        measured = vit_vs_timm(**config, repeats=repeats)  # type: ignore[arg-type]
        results["vit_vs_timm"][name] = measured
        rows.append((f"{name}: train step, ours vs timm (batch {config['batch']})",
                     f"{measured['ours_train_images_per_s']:.0f} vs {measured['timm_train_images_per_s']:.0f} img/s "
                     f"(ratio {measured['train_ratio']:.2f})", "ratio ≥ 1.0"))
        rows.append((f"{name}: train step, ours with fused_attention=False vs timm",
                     f"{measured['ours_unfused_train_images_per_s']:.0f} vs {measured['timm_train_images_per_s']:.0f} "
                     f"img/s (ratio {measured['unfused_train_ratio']:.2f})", "report"))
        rows.append((f"{name}: inference, ours vs timm",
                     f"{measured['ours_inference_images_per_s']:.0f} vs {measured['timm_inference_images_per_s']:.0f} "
                     f"img/s (ratio {measured['inference_ratio']:.2f})", "ratio ≥ 1.0"))
        rows.append((f"{name}: forward with attention maps / without", f"{measured['attention_maps_time_ratio']:.2f}×",
                     "≤ 1.5×"))

    # 2. utilisation of the ViT-Tiny forward against the measured matmul peak
    tiny = vit_configs["ViT-Tiny/16 at 224"]
    peak = matmul_gflops(512 if quick else 2048, repeats=repeats)
    flops = vit_forward_flops(img_size=tiny["img_size"], patch_size=16, in_chans=3, embed_dim=192,
                              depth=tiny["depth"], num_classes=1000)
    achieved = flops * results["vit_vs_timm"]["ViT-Tiny/16 at 224"]["ours_inference_images_per_s"] / 1e9
    results["utilisation"] = {"forward_gflops_per_image": flops / 1e9, "achieved_gflops_per_s": achieved,
                              "matmul_peak_gflops_per_s": peak, "fraction": achieved / peak,
                              "formula": VIT_FLOPS_FORMULA}
    rows.append((f"ViT-Tiny forward: {flops / 1e9:.2f} GFLOP/image, achieved / fp32 matmul peak",
                 f"{achieved:.0f} / {peak:.0f} GFLOP/s = {achieved / peak:.0%}", "≥ 60%"))

    # 3. captioner train step at COCO dims, against the tutorial-style reference; growth with L and T
    vocab, width, batch = (1000, 64, 8) if quick else (10000, 512, 32)
    step_dims = [(512, 49, 5)] if quick else [(2048, 196, 20), (512, 196, 20)]
    results["captioner_train_step"] = []
    for annotation_dim, locations, length in step_dims:
        measured = captioner_train_step(annotation_dim=annotation_dim, locations=locations, length=length,
                                       batch=batch, vocab_size=vocab, width=width, repeats=2 if quick else 5)
        results["captioner_train_step"].append({"D": annotation_dim, "L": locations, "T": length, **measured})
        rows.append((f"captioner train step D={annotation_dim} L={locations} T={length} B={batch}: ours vs "
                     "tutorial-style",
                     f"{measured['ours_images_per_s']:.1f} vs {measured['reference_images_per_s']:.1f} img/s, "
                     f"{measured['ours_s']:.2f} s/step ({measured['speedup']:.2f}×)", "≥ 2×"))
    step = dict(annotation_dim=512, batch=batch, vocab_size=vocab, width=width, repeats=2 if quick else 3)
    fixed_length, fixed_locations = (5, 49) if quick else (20, 196)
    by_locations = {n: captioner_step_time(locations=n, length=fixed_length, **step)
                    for n in ((16, 49) if quick else (49, 196, 784))}
    by_length = {n: captioner_step_time(locations=fixed_locations, length=n, **step)
                 for n in ((5, 10) if quick else (10, 20, 40))}
    results["captioner_growth"] = {"by_L": by_locations, "by_T": by_length}
    rows.append((f"captioner train step vs L (D=512, T={fixed_length}, B={batch}): "
                 + ", ".join(f"L={n}: {t:.2f} s" for n, t in by_locations.items()), growth(by_locations), "report"))
    rows.append((f"captioner train step vs T (D=512, L={fixed_locations}, B={batch}): "
                 + ", ".join(f"T={n}: {t:.2f} s" for n, t in by_length.items()), growth(by_length), "report"))
    encoder_batch, encoder_size = (2, 64) if quick else (16, 224)
    encoder_seconds = captioner_step_time(annotation_dim=2048, locations=49, length=fixed_length,
                                          batch=encoder_batch, vocab_size=vocab, width=width, repeats=1 if quick else 2,
                                          encoder="resnet50", image_size=encoder_size)
    results["captioner_resnet50_step"] = {"batch": encoder_batch, "seconds": encoder_seconds,
                                          "images_per_s": encoder_batch / encoder_seconds}
    rows.append((f"captioner train step with a ResNet-50 encoder fine-tuned ({encoder_size} px, D=2048, "
                 f"T={fixed_length}, B={encoder_batch})",
                 f"{encoder_batch / encoder_seconds:.1f} img/s, {encoder_seconds:.2f} s/step", "report"))

    # 4. batched beam search against one image at a time
    results["beam_search"] = {}
    for k in (1, 3) if quick else (1, 3, 5, 10):
        beam = beam_search_speed(beam_size=k, batch=8 if quick else 64, vocab_size=vocab,
                                 locations=49 if quick else 196, width=width, max_length=5 if quick else 20)
        results["beam_search"][str(k)] = beam
        rows.append((f"beam search k={k}, batch {8 if quick else 64}: batched vs one image at a time",
                     f"{beam['batched_images_per_s']:.1f} vs {beam['single_images_per_s']:.1f} img/s "
                     f"({beam['speedup']:.1f}×)", "≥ 10× at k=5" if k == 5 else "report"))

    # 5. data
    vocabulary = vocabulary_speed(20_000 if quick else 616_000)
    results["vocabulary"] = vocabulary
    rows.append((f"vocabulary build + encode, {int(vocabulary['captions']):,} captions",
                 f"{vocabulary['total_s']:.2f} s", "≤ 10 s"))
    decode = image_decode_speed(count=8 if quick else 64)
    results["image_decode"] = decode
    rows.append(("image decode + resize to 224 (640×480 JPEG, the captioning DataModule's path), one core",
                 f"{decode['images_per_s_per_core']:.0f} img/s", "report"))
    if not quick:
        scenes = scenes_speed(count=2000)
        results["scenes"] = scenes
        rows.append(("Fashion scenes generation (2000/200/200, files written)",
                     f"{scenes['scenes_per_s']:.0f} scenes/s", "report"))

    feature_cache_rows(options, results, rows)

    # 7. time to quality (minutes each: only on request)
    if options.vit_quality:
        quality = time_to_quality("vit")
        results["vit_quality"] = quality
        accuracy = quality["metrics"].get("test/acc", float("nan"))
        rows.append(("ViT Fashion-MNIST test accuracy after `fit` (the config's epochs)",
                     f"{accuracy:.2%} (fit {quality['fit_wall_s'] / 60:.1f} min)", "≥ 90%"))
    if options.captioner_quality:
        quality = time_to_quality("captioner")
        results["captioner_quality"] = quality
        bleu, pointing = (quality["metrics"].get(k, float("nan")) for k in ("test/BLEU-4", "test/pointing_accuracy"))
        rows.append(("captioner on Fashion scenes: test BLEU-4 / pointing (config capped at 15 min)",
                     f"{bleu:.3f} / {pointing:.3f} (fit {quality['fit_wall_s'] / 60:.1f} min)", "≥ 0.60 / ≥ 0.90"))
    results["table"] = markdown_table(rows)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="vision-attn benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not measured")
    parser.add_argument("--threads", type=bounded_int(0, 1024, "more threads than cores only slow a run down"),
                        default=0, help="torch threads, up to 1024 (default 0: all cores)")
    parser.add_argument("--out", default="benchmark.json", help="where to write the JSON (default benchmark.json)")
    parser.add_argument("--gpu-tflops", type=number_in(0.001, 100_000, why="no GPU reaches 100 PFLOP/s"),
                        default=100.0,
                        help="the sustained TFLOP/s of the GPU the COCO epoch projection assumes (default 100)")
    parser.add_argument("--only", choices=["feature-cache"], default=None,
                        help="run one section only (feature-cache: the cached vs uncached COCO-shape step)")
    parser.add_argument("--vit-quality", action="store_true",
                        help="also run the ViT Fashion-MNIST fit + test (the config's epochs) and report test accuracy")
    parser.add_argument("--captioner-quality", action="store_true",
                        help="also run the scenes captioner fit + test (its config's steps); BLEU-4, pointing")
    parser.add_argument("--device", type=device, default=None,
                        help="measure speed on this device instead (cuda or cpu: the paper-shape captioner, ViT-B/16 "
                             "against timm, the feature cache; fp32, bf16-mixed, 16-mixed; benchmarks/device.py)")
    parser.add_argument("--compile", action="store_true",
                        help="with --device: also time the captioner's train step and beam search compiled "
                             "(decoder.compile: default, and reduce-overhead on a GPU)")
    parser.add_argument("--sections", nargs="+", choices=["captioner", "vit", "feature-cache"],
                        default=["captioner", "vit", "feature-cache"],
                        help="with --device: the parts to measure (default all; the COCO epoch needs all)")
    options = parser.parse_args(argv)
    with exit_on_user_error():  # a bad output path, missing data: one line, as every vision-attn tool says it
        out = output_file(options.out)  # refused before minutes of measuring, not after
        if options.device:
            results = run_on_device(options.device, quick=options.quick, compile_decoder=options.compile,
                                    sections=tuple(options.sections))
        else:
            results = run(options)
        print(results["table"])
        replace_atomically(out, lambda file: file.write(json.dumps(results, indent=2).encode("utf-8")))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
