"""Our captioner beside ruotianluo/ImageCaptioning.pytorch's on a CUDA GPU: ``python -m benchmarks.peers_gpu``.

``benchmarks/peers.py`` compares the train steps on a CPU; this compares them on a GPU, in fp32 and bf16-mixed,
and beam search too. Their Att2in2 and UpDown (``--models``) against our recipe's path: the decoder through
``decoder.compile`` in ``--compile`` mode (the COCO recipes' reduce-overhead), and eager beside it. Each side gets
the same random annotation vectors and captions at the paper's shape (B=64, L=196, D=512, widths 512, T=20, 10k
words). The train step: teacher-forced forward, the masked cross-entropy, backward, an Adam step. Beam search at
k = 3 and 5: every image decodes T words (ours with ``min_length`` = T; theirs has no <end> learnt, as neither
is trained). Their code is read at run time from the snapshot ``--ruotianluo`` names, as ``peers.py`` reads it.
Every time is a median between CUDA events, the runs taken in turns. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.device import autocast
from benchmarks.peers import (
    PEER_MODELS,
    PEER_NAMES,
    Shape,
    load_peer,
    our_decoder,
    peer_options,
    peer_step,
    step_inputs,
)
from benchmarks.run import decoder_train_step, markdown_table
from benchmarks.timing import median_times
from vision_attn.captioning.beam_search import beam_search
from vision_attn.cli_arguments import OneLineParser, at_least
from vision_attn.data.vocabulary import END_ID, START_ID
from vision_attn.errors import exit_on_user_error
from vision_attn.io import output_file, write_json_atomically

PRECISIONS = ("32-true", "bf16-mixed")
GOAL = "≥ 3×"


def train_runs(peer: Any, models: tuple[str, ...], shape: Shape, device: torch.device, precision: str,
               compile_mode: str) -> dict[str, Callable[[], None]]:
    """One train step of each side, in ``precision``: ours eager and compiled, theirs."""
    annotations, captions = (tensor.to(device) for tensor in step_inputs(shape))
    runs = {}
    for name, mode in (("ours", None), ("ours_compiled", compile_mode)):
        decoder = our_decoder(shape, device, compile_mode=mode, train=True)
        optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)

        def step(decoder=decoder, optimizer=optimizer) -> None:
            with autocast(device, precision):
                decoder_train_step(decoder, optimizer, annotations, captions)
        runs[name] = step
    for name in models if peer is not None else ():
        theirs = peer_step(peer, name, shape, annotations, captions, device=device)

        def step(theirs=theirs) -> None:
            with autocast(device, precision):
                theirs()
        runs[name] = step
    return runs


def beam_runs(peer: Any, models: tuple[str, ...], shape: Shape, device: torch.device, precision: str,
              compile_mode: str, beam_size: int) -> dict[str, Callable[[], None]]:
    """Beam search of ``shape.batch`` images at ``beam_size``, T words each, by each side, in ``precision``."""
    annotations = step_inputs(shape)[0].to(device)
    runs = {}
    for name, mode in (("ours", None), ("ours_compiled", compile_mode)):
        decoder = our_decoder(shape, device, compile_mode=mode, train=False)

        @torch.no_grad()
        def search(decoder=decoder) -> None:
            with autocast(device, precision):
                beam_search(decoder, annotations, start_id=START_ID, end_id=END_ID, beam_size=beam_size,
                            max_length=shape.length, min_length=shape.length)
        runs[name] = search
    fc_feats = annotations.mean(dim=1)
    for name in models if peer is not None else ():
        torch.manual_seed(0)
        model = getattr(peer, name)(peer_options(shape)).to(device).eval()

        @torch.no_grad()
        def search(model=model) -> None:
            with autocast(device, precision):
                options = {"beam_size": beam_size, "sample_method": "greedy", "sample_n": 1}
                model(fc_feats, annotations, None, opt=options, mode="sample")
        runs[name] = search
    return runs


def timed(runs: dict[str, Callable[[], None]], device: torch.device, repeats: int, count: int) -> dict[str, Any]:
    """Each run's first call (compiling, for ours compiled), then medians in turns; per-second rates of ``count``
    items and each peer's ratio to ours."""
    first = {}
    for name, run in runs.items():
        started = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        first[name] = time.perf_counter() - started
    seconds = median_times(device, runs, repeats=repeats, warmup=2)
    figures: dict[str, Any] = {name: {"seconds": seconds[name], "per_s": count / seconds[name],
                                      "first_call_s": first[name]} for name in runs}
    for name in runs:
        if name in PEER_MODELS:
            figures[name]["ours_speedup"] = seconds[name] / seconds["ours"]
            figures[name]["ours_compiled_speedup"] = seconds[name] / seconds["ours_compiled"]
    return figures


def table_rows(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = [("device", f"{results['machine']['device']} (torch {results['machine']['torch']})", ""),
            ("ruotianluo snapshot", results["peer"]["commit"] if results["peer"] else "not given: ours only", "")]
    mode = results["compile"]
    for precision, sections in results["precisions"].items():
        for section, unit in (("train_step", "captions/s"), *((f"beam k={k}", "images/s") for k in results["beam"])):
            figures = sections[section]
            ours, compiled = figures["ours"], figures["ours_compiled"]
            rows.append((f"{section}, {precision}: ours eager / compiled {mode}",
                         f"{ours['per_s']:,.0f} / {compiled['per_s']:,.0f} {unit} (compiled first call "
                         f"{compiled['first_call_s']:.0f} s)", "report"))
            for name in PEER_MODELS:
                if name in figures:
                    theirs = figures[name]
                    rows.append((f"{section}, {precision}: ruotianluo's {PEER_NAMES[name]}",
                                 f"{theirs['per_s']:,.0f} {unit}: ours {theirs['ours_compiled_speedup']:.2f}× "
                                 f"(eager {theirs['ours_speedup']:.2f}×)", GOAL))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.peers_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--ruotianluo", type=Path, default=None, help="a snapshot of ruotianluo/"
                        "ImageCaptioning.pytorch: a git directory or a checkout (without it, ours only)")
    parser.add_argument("--models", nargs="+", choices=list(PEER_MODELS), default=["att2in2", "updown"],
                        help="their models (default att2in2 updown)")
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--compile", default="reduce-overhead", choices=["default", "reduce-overhead"],
                        help="our decoder.compile mode (default reduce-overhead, the COCO recipes')")
    parser.add_argument("--beam", nargs="*", type=at_least(1, 20), default=[3, 5], help="beam sizes (default 3 5)")
    parser.add_argument("--repeats", type=at_least(1, 1000), default=10, help="timed turns (default 10)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    parser.add_argument("--out", default="peers_gpu.json", help="the JSON written (default peers_gpu.json)")
    options = parser.parse_args(argv)
    with exit_on_user_error():
        out = output_file(options.out)
        if not torch.cuda.is_available():
            raise ValueError("benchmarks.peers_gpu needs a CUDA GPU, and torch sees none here "
                             "(on a CPU: python -m benchmarks.peers)")
        if options.ruotianluo is not None and not options.ruotianluo.exists():
            raise FileNotFoundError(f"--ruotianluo {options.ruotianluo}: no such folder")
        peer = load_peer(options.ruotianluo) if options.ruotianluo is not None else None
        device = torch.device("cuda")
        shape = Shape(batch=4, locations=9, dim=16, width=16, vocab=50, length=5) if options.tiny else Shape()
        models = tuple(options.models)
        results: dict[str, Any] = {
            "machine": {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                        "date": time.strftime("%Y-%m-%d")},
            "peer": None if peer is None else {"source": str(options.ruotianluo), "commit": peer.commit},
            "shape": asdict(shape), "compile": options.compile,
            "beam": options.beam, "precisions": {}}
        for precision in options.precisions:
            sections = {"train_step": timed(train_runs(peer, models, shape, device, precision, options.compile),
                                            device, options.repeats, shape.batch)}
            for k in options.beam:
                sections[f"beam k={k}"] = timed(beam_runs(peer, models, shape, device, precision, options.compile, k),
                                                device, options.repeats, shape.batch)
            results["precisions"][precision] = sections
            print(f"{precision}: done", flush=True)
        results["table"] = markdown_table(table_rows(results))
        print(results["table"])
        write_json_atomically(out, results)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
