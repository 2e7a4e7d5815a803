"""Milliseconds the Fashion scenes decoder takes per training step and per beam search, for each attention score.

    python -m scripts.attention_score_step_time [SCORE ...]     (from the repository root; default: every score)

The decoder alone, at configs/captioner/fashion_scenes.yaml's sizes (embed 128, hidden 256, attention 128,
coverage, attend_with_word, word_counts; 12x12 annotation vectors of 192 dims, as its small encoder of width 24
gives at 96 px), on random inputs: a teacher-forced forward + backward over 32 images x 5 captions of 14
tokens (the config's batch), and a beam search of 3 over 100 images (its eval batch), 12 words each. Each
figure is the median of 10 runs after 2 warm-up runs. Run it on an idle machine.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.timing import median_seconds
from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import ATTENTION_SCORES, AttentionDecoder

VOCAB, LOCATIONS, WIDTH = 40, 144, 192


def median_ms(run, repeats: int = 10, warmup: int = 2) -> float:
    return 1000 * median_seconds(run, repeats=repeats, warmup=warmup)


def measure(score: str) -> tuple[float, float]:
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=VOCAB, annotation_dim=WIDTH, embed_dim=128, hidden_dim=256,
                               attention_dim=128, dropout=0.3, attention_inputs=["previous_word", "coverage"],
                               output_terms=["word_counts"], attention_score=score)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-3)
    annotations = torch.randn(32, LOCATIONS, WIDTH)
    captions = torch.randint(3, VOCAB, (160, 15))
    captions[:, 0] = 1

    def train_step() -> None:
        decoder.train()
        logits = decoder(annotations, captions).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), captions[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    evaluation = torch.randn(100, LOCATIONS, WIDTH)

    def search() -> None:
        decoder.eval()
        beam_search(decoder, evaluation, start_id=1, end_id=2, beam_size=3, max_length=12, min_length=12)

    return median_ms(train_step), median_ms(search, repeats=5, warmup=1)


def main(scores: list[str]) -> None:
    unknown = [score for score in scores if score not in ATTENTION_SCORES]
    if unknown:
        print(f"unknown score {unknown[0]!r}: use {', '.join(ATTENTION_SCORES)}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(torch.get_num_threads())
    print(f"{'score':12s} {'train step (ms)':>16s} {'beam search (ms)':>17s}")
    for score in scores:
        train, search = measure(score)
        print(f"{score:12s} {train:16.1f} {search:17.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(ATTENTION_SCORES))
