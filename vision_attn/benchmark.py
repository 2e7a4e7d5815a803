"""Measured speed, side by side: ``vision-attn benchmark`` (also ``python scripts/benchmark.py``).

Every figure is the median of repeated runs after warm-up; every comparison is a ratio measured in the same
process. Prints a markdown table and writes JSON. ``--quick`` shrinks sizes for a smoke test.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.losses import caption_nll
from vision_attn.captioning.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary


def median_seconds(run: Callable[[], Any], *, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of ``run`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class TutorialStyleDecoder(nn.Module):
    """The reference for the captioner's speed goal: the per-step structure of the best-known PyTorch
    "Show, Attend and Tell" tutorial, re-written here for timing. Captions are sorted by length and the
    batch shrinks as they end; at every step it recomputes the encoder projection W_a a_i, gates with a
    D-sized β, and projects to the vocabulary one step at a time.
    """

    def __init__(self, *, vocab_size: int, annotation_dim: int, embed_dim: int, hidden_dim: int,
                 attention_dim: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.encoder_att = nn.Linear(annotation_dim, attention_dim)
        self.decoder_att = nn.Linear(hidden_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.decode_step = nn.LSTMCell(embed_dim + annotation_dim, hidden_dim)
        self.init_h = nn.Linear(annotation_dim, hidden_dim)
        self.init_c = nn.Linear(annotation_dim, hidden_dim)
        self.f_beta = nn.Linear(hidden_dim, annotation_dim)
        self.fc = nn.Linear(hidden_dim, vocab_size)

    def forward(self, annotations: Tensor, captions: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        lengths, order = lengths.sort(descending=True)
        annotations, captions = annotations[order], captions[order]
        embedded = self.embedding(captions)
        mean = annotations.mean(dim=1)
        hidden, cell = self.init_h(mean), self.init_c(mean)
        decode_lengths = (lengths - 1).tolist()
        batch, steps = len(captions), max(decode_lengths)
        predictions = annotations.new_zeros(batch, steps, self.fc.out_features)
        for t in range(steps):
            live = sum(length > t for length in decode_lengths)
            projected = self.encoder_att(annotations[:live])  # recomputed at every step
            scores = self.full_att(F.relu(projected + self.decoder_att(hidden[:live]).unsqueeze(1))).squeeze(2)
            alpha = scores.softmax(dim=1)
            context = (annotations[:live] * alpha.unsqueeze(2)).sum(dim=1)
            context = torch.sigmoid(self.f_beta(hidden[:live])) * context
            hidden, cell = self.decode_step(torch.cat([embedded[:live, t], context], dim=1),
                                            (hidden[:live], cell[:live]))
            predictions[:live, t] = self.fc(self.dropout(hidden))
        return predictions, captions, decode_lengths


def random_captions(batch: int, length: int, vocab_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(B, length + 2) ids <start> w.. <end> <pad>.. with lengths spread from length/2 to length words."""
    words = torch.randint(4, vocab_size, (batch, length), generator=generator)
    counts = torch.randint(length // 2, length + 1, (batch,), generator=generator)
    captions = torch.full((batch, length + 2), PAD_ID)
    captions[:, 0] = START_ID
    for row, count in enumerate(counts.tolist()):
        captions[row, 1 : count + 1] = words[row, :count]
        captions[row, count + 1] = END_ID
    return captions, counts + 2


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
        output = ours(annotations, captions)
        targets = captions[:, 1:]
        mask = (targets != PAD_ID).float()
        loss = caption_nll(output.logits, targets, mask).sum() / mask.sum()
        ours_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ours_optimizer.step()

    def reference_step() -> None:
        predictions, sorted_captions, decode_lengths = reference(annotations, captions, lengths)
        targets = sorted_captions[:, 1:]
        packed = nn.utils.rnn.pack_padded_sequence(predictions, decode_lengths, batch_first=True).data
        packed_targets = nn.utils.rnn.pack_padded_sequence(targets, decode_lengths, batch_first=True).data
        loss = F.cross_entropy(packed, packed_targets)
        reference_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reference_optimizer.step()

    ours_time = median_seconds(ours_step, repeats=repeats, warmup=1)
    reference_time = median_seconds(reference_step, repeats=repeats, warmup=1)
    return {"ours_s": ours_time, "reference_s": reference_time, "ours_images_per_s": batch / ours_time,
            "reference_images_per_s": batch / reference_time, "speedup": reference_time / ours_time}


@torch.no_grad()
def beam_search_speed(*, beam_size: int, batch: int = 64, vocab_size: int = 10000, annotation_dim: int = 512,
                      locations: int = 196, width: int = 512, max_length: int = 20) -> dict[str, float]:
    """Images/s of the batched beam search against decoding the same images one at a time."""
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=vocab_size, annotation_dim=annotation_dim, embed_dim=width,
                               hidden_dim=width, attention_dim=width).eval()
    annotations = torch.randn(batch, locations, annotation_dim)
    search = dict(start_id=START_ID, end_id=END_ID, beam_size=beam_size, max_length=max_length)
    batched = median_seconds(lambda: beam_search(decoder, annotations, **search), repeats=3, warmup=1)
    one_by_one = median_seconds(lambda: [beam_search(decoder, annotations[i : i + 1], **search)
                                         for i in range(batch)], repeats=1, warmup=0)
    return {"batched_images_per_s": batch / batched, "single_images_per_s": batch / one_by_one,
            "speedup": one_by_one / batched}


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


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| what | figure | goal |", "| --- | --- | --- |"]
    lines += [f"| {what} | {figure} | {goal} |" for what, figure, goal in rows]
    return "\n".join(lines)


def run(options: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(options.threads or torch.get_num_threads())
    quick = options.quick
    results: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                           "threads": torch.get_num_threads(), "torch": torch.__version__,
                                           "date": time.strftime("%Y-%m-%d")}}
    rows: list[tuple[str, str, str]] = []
    vocab = vocabulary_speed(20_000 if quick else 616_000)
    results["vocabulary"] = vocab
    rows.append((f"vocabulary build + encode, {int(vocab['captions']):,} captions", f"{vocab['total_s']:.2f} s",
                 "≤ 10 s"))
    step_dims = [(512, 49, 5, 8)] if quick else [(2048, 196, 20, 32), (512, 196, 20, 32)]
    results["captioner_train_step"] = []
    for annotation_dim, locations, length, batch in step_dims:
        figures = captioner_train_step(annotation_dim=annotation_dim, locations=locations, length=length,
                                       batch=batch, vocab_size=1000 if quick else 10000,
                                       width=64 if quick else 512, repeats=2 if quick else 3)
        results["captioner_train_step"].append({"D": annotation_dim, "L": locations, "T": length, **figures})
        rows.append((f"captioner train step D={annotation_dim} L={locations} T={length} B={batch}: ours vs "
                     "tutorial-style", f"{figures['ours_images_per_s']:.1f} vs {figures['reference_images_per_s']:.1f}"
                     f" img/s ({figures['speedup']:.2f}×)", "≥ 2×"))
    beam = beam_search_speed(beam_size=5, batch=8 if quick else 64, vocab_size=1000 if quick else 10000,
                             locations=49 if quick else 196, width=64 if quick else 512,
                             max_length=5 if quick else 20)
    results["beam_search_k5"] = beam
    rows.append(("beam search k=5, batched vs one image at a time",
                 f"{beam['batched_images_per_s']:.1f} vs {beam['single_images_per_s']:.1f} img/s "
                 f"({beam['speedup']:.1f}×)", "≥ 10×"))
    results["table"] = markdown_table(rows)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vision-attn benchmark", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not figures")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--out", default="benchmark.json", help="where to write the JSON (default benchmark.json)")
    options = parser.parse_args(argv)
    results = run(options)
    print(results["table"])
    Path(options.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {options.out}")


if __name__ == "__main__":
    main()
