"""Check that ``decoder.compile`` gives the eager numbers on this machine's device, before trusting its speed.

    python scripts/compiled_decoder_check.py [--device cuda] [--modes default reduce-overhead]

A small decoder with every output path (coverage, the word in the score, word counts) is compiled as the
captioner task compiles it (``compile_decoder``), then beam search and teacher forcing run on batches of several
sizes, one of them equal to the number of locations (a coincidence of sizes dynamo may trace as one symbol), and
are compared with the eager decoder: the same beams, log-probabilities within 1e-3, logits within 1e-4. Prints
one line per case and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vision_attn.captioning.beam_search import beam_search  # noqa: E402
from vision_attn.captioning.compiled import compile_decoder  # noqa: E402
from vision_attn.captioning.decoder import AttentionDecoder  # noqa: E402
from vision_attn.data.vocabulary import END_ID, START_ID  # noqa: E402

VOCAB, DIM, LOCATIONS = 23, 12, 9
SHAPES = ((3, 4), (2, 5), (4, 4), (3, 3))  # (images, caption length): beam 3 over 3 images is 9 rows = LOCATIONS


def decoder(device: torch.device) -> AttentionDecoder:
    """The small decoder, seeded, with the word counts' weights away from their zero start."""
    torch.manual_seed(0)
    model = AttentionDecoder(vocab_size=VOCAB, annotation_dim=DIM, embed_dim=8, hidden_dim=16, attention_dim=8,
                             dropout=0.0, attention_inputs=["coverage", "previous_word"],
                             output_terms=[{"name": "word_counts", "context": True}])
    with torch.no_grad():
        model.output_terms.word_counts.weight.normal_(0, 0.1)
        model.output_terms.word_counts.context.weight.normal_(0, 0.1)
    return model.to(device).eval()


def compile_as(model: AttentionDecoder, mode: str, variant: str) -> None:
    """``compile_decoder``, or (``variant`` static / auto / dynamic) torch.compile of forward and step with that
    ``dynamic`` setting, to tell which one a device computes right."""
    if variant == "library":
        compile_decoder(model, mode)
        return
    dynamic = {"static": False, "auto": None, "dynamic": True}[variant]
    for name in ("forward", "step"):
        setattr(model, name, torch.compile(getattr(model, name), mode=mode, dynamic=dynamic))


def compare(device: torch.device, mode: str, variant: str = "library") -> list[str]:
    """The differences between eager and ``mode`` over ``SHAPES`` (empty: none), printing each case."""
    eager = decoder(device)
    compiled = copy.deepcopy(eager)
    compile_as(compiled, mode, variant)
    problems = []
    generator = torch.Generator().manual_seed(1)
    for images, length in SHAPES:
        annotations = torch.randn(images, LOCATIONS, DIM, generator=generator).to(device)
        words = torch.randint(4, VOCAB, (images, length + 1), generator=generator)
        words[:, 0], words[:, -1] = START_ID, END_ID
        with torch.no_grad():
            found = [beam_search(model, annotations, start_id=START_ID, end_id=END_ID, beam_size=3,
                                 max_length=length) for model in (eager, compiled)]
            logits = [model(annotations, words.to(device)).logits.float().cpu() for model in (eager, compiled)]
        same = all(a[0].tokens == b[0].tokens for a, b in zip(*found, strict=True))
        gap = max(abs(float(a[0].log_prob) - float(b[0].log_prob)) for a, b in zip(*found, strict=True))
        logit_gap = (logits[0] - logits[1]).abs().max().item()
        ok = same and gap < 1e-3 and logit_gap < 1e-4
        print(f"{device.type} {mode:<16} {variant:<8} images {images} length {length}: "
              f"beams {'same' if same else 'DIFFER'}, "
              f"log-prob gap {gap:.2e}, logit gap {logit_gap:.2e} {'ok' if ok else 'WRONG'}", flush=True)
        if not ok:
            problems.append(f"{mode} {variant} at images {images}, length {length}")
    return problems


def main() -> None:
    """Compare every asked mode; exit 1 naming the cases that differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--modes", nargs="+", default=["default"], help="torch.compile modes (default: default)")
    parser.add_argument("--variants", nargs="+", default=["library"], choices=["library", "static", "auto", "dynamic"],
                        help="library: compile_decoder as the task runs it (default); the others: torch.compile's "
                             "dynamic=False / None / True")
    options = parser.parse_args()
    problems = [problem for mode in options.modes for variant in options.variants
                for problem in compare(torch.device(options.device), mode, variant)]
    if problems:
        print(f"compiled decoder differs from eager: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(1)
    print("compiled decoder equals eager in every case")


if __name__ == "__main__":
    main()
