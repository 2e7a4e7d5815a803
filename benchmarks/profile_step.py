"""Profile one piece of work with torch.profiler and print the operators that take the time.

    python -m benchmarks.profile_step beam --batch 64 --beam 5       # batched beam search, COCO dims
    python -m benchmarks.profile_step captioner --annotation-dim 512   # one decoder train step, COCO dims
    python -m benchmarks.profile_step vit                               # one train step of the Fashion-MNIST ViT
    python -m benchmarks.profile_step activations                       # tanh against 2σ(2x) − 1 on 2M floats
    python -m benchmarks.profile_step rows                              # 1..8 rows times the 10k×512 vocabulary

The sizes are those of `vision-attn benchmark`. Use it to find where a step's time goes before changing code.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.run import decoder_train_step
from benchmarks.synthetic import random_captions
from benchmarks.timing import paired_median_seconds
from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.data.vocabulary import END_ID, START_ID
from vision_attn.vit.vision_transformer import VisionTransformer


def coco_decoder(annotation_dim: int) -> AttentionDecoder:
    torch.manual_seed(0)
    return AttentionDecoder(vocab_size=10000, annotation_dim=annotation_dim, embed_dim=512, hidden_dim=512,
                            attention_dim=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["beam", "captioner", "vit", "activations", "rows"])
    parser.add_argument("--batch", type=int, default=64, help="images (beam: 64, captioner: 32, vit: 256)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--annotation-dim", type=int, default=512)
    parser.add_argument("--rows", type=int, default=25, help="operators to print")
    options = parser.parse_args()

    if options.what == "activations":
        x = torch.randn(2**21)
        times = paired_median_seconds({"tanh(x)": lambda: torch.tanh(x),
                                       "2σ(2x) − 1": lambda: torch.mul(x, 2.0).sigmoid_().mul_(2.0).sub_(1.0)},
                                      repeats=21)
        for name, seconds in times.items():
            print(f"{name}: {seconds * 1e3:.2f} ms for {x.numel():,} floats")
        return
    if options.what == "rows":  # the one-image beam search multiplies k rows by the vocabulary projection
        weight = torch.randn(10000, 512)
        inputs = {rows: torch.randn(rows, 512) for rows in range(1, 9)}
        times = paired_median_seconds({f"{rows} rows": lambda x=x: F.linear(x, weight) for rows, x in inputs.items()},
                                      repeats=51)
        for name, seconds in times.items():
            print(f"{name} × (512 → 10000): {seconds * 1e3:.2f} ms")
        return
    if options.what == "beam":
        decoder = coco_decoder(options.annotation_dim).eval()
        annotations = torch.randn(options.batch, 196, options.annotation_dim)

        def work() -> None:
            with torch.no_grad():
                beam_search(decoder, annotations, start_id=START_ID, end_id=END_ID, beam_size=options.beam,
                            max_length=20, min_length=20)
    elif options.what == "captioner":
        decoder = coco_decoder(options.annotation_dim)
        optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        batch = options.batch if options.batch != 64 else 32
        annotations = torch.randn(batch, 196, options.annotation_dim, generator=generator)
        captions, _ = random_captions(batch, 20, 10000, generator)

        def work() -> None:
            decoder_train_step(decoder, optimizer, annotations, captions)
    else:
        torch.manual_seed(0)
        model = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=96, depth=4,
                                  num_heads=4, mlp_ratio=2.0, global_pool="avg")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = options.batch if options.batch != 64 else 256
        images, labels = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

        def work() -> None:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    work()  # warm-up
    start = time.perf_counter()
    work()
    print(f"{options.what}: {time.perf_counter() - start:.3f} s without the profiler")
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        work()
    print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=options.rows))


if __name__ == "__main__":
    main()
