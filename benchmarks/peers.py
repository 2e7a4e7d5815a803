"""Our captioner's train step beside ruotianluo/ImageCaptioning.pytorch's: ``python -m benchmarks.peers``.

Their Att2in2, UpDown and Att2in (``captioning/models/AttModel.py``) are timed against our ``AttentionDecoder`` at
the same widths, on the same random annotation vectors and captions, in turns in one process (2 threads, fp32):
teacher-forced forward, a masked cross-entropy, backward, an Adam step. Their code is no part of this project: it
is read at run time from a snapshot given by ``--ruotianluo PATH`` (a git directory, bare or not, or a checkout),
its few files copied to a temporary folder and imported from there. Without ``--ruotianluo`` only our side runs.

Beside the ratios: our step's matrix-product FLOPs (``decoder_matmul_flops``) over its wall time as a share of a
2048³ ``torch.mm`` timed in the same turns, eager and through ``decoder.compile``; and the rate of a product of
the LSTM's per-step shape, which bounds what the recurrence can reach. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.device import cpu_description
from benchmarks.run import decoder_train_step, markdown_table
from benchmarks.synthetic import random_captions
from benchmarks.timing import paired_median_seconds
from vision_attn.captioning.compiled import compile_decoder
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.cli_arguments import OneLineParser, at_least
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID
from vision_attn.errors import exit_on_user_error
from vision_attn.io import output_file, write_json_atomically

PEER_PACKAGE = "ruotianluo_captioning"  # the name their ``captioning`` package is imported under here
PEER_FILES = ("captioning/models/AttModel.py", "captioning/models/CaptionModel.py", "captioning/models/FCModel.py",
              "captioning/models/utils.py", "captioning/utils/misc.py")  # AttModel.py and what it imports
PEER_LOSSES = "captioning/modules/losses.py"  # LanguageModelCriterion is read from it (its imports need pycocoevalcap)
PEER_MODELS = {"att2in2": "Att2in2Model", "updown": "UpDownModel", "att2in": "Att2inModel"}
PEER_NAMES = {"att2in2": "Att2in2", "updown": "UpDown", "att2in": "Att2in"}
PEER_GOALS = {"att2in2": "≥ 1.5×", "updown": "≥ 1.5×", "att2in": "report"}
MATMUL_SIZE = 2048
SIZE_LIMITS = {"batch": 1024, "locations": 4096, "dim": 4096, "width": 4096, "vocab": 200_000, "length": 200}


@dataclass(frozen=True)
class Shape:
    """A train step's sizes: ``batch`` captions (one per image) of ``length`` words (T) over ``locations``
    annotation vectors (L) of ``dim`` dimensions (D); every width (embedding, LSTM, attention) ``width``; ``vocab``
    words. The default is the paper's shape."""

    batch: int = 64
    locations: int = 196
    dim: int = 512
    width: int = 512
    vocab: int = 10000
    length: int = 20


TINY = Shape(batch=4, locations=9, dim=16, width=16, vocab=50, length=5)


def step_memory_bytes(shape: Shape) -> int:
    """A rough bound on one model's train step in memory: what backward keeps of the attention, B·L·A at each of
    the S steps, twice; the annotations and W_a a; the logits and their gradients, B·S·V four times; in fp32."""
    b, s = shape.batch, shape.length + 1
    return 4 * (2 * s * b * shape.locations * shape.width + b * shape.locations * (shape.dim + shape.width)
                + 4 * b * s * shape.vocab)


def decoder_matmul_flops(shape: Shape) -> dict[str, Any]:
    """The matrix-product FLOPs of one train step of our decoder (default options: additive score, gate β, soft
    attention), forward and backward, counted by hand.

    A product of an (m, k) by a (k, n) matrix costs 2·m·n·k FLOPs forward. Backward it costs as much again for
    the gradient of each operand that needs one: 2× forward when both do (activations and weights), 1× when one
    is the input (the annotation vectors a need no gradient). With B captions, S = T + 1 decoding steps (the
    inputs <start> w_1 .. w_T), widths E = H = A = ``width`` and D = ``dim``:

    - once per image: W_a a_i, 2·B·L·D·A, and f_init,h, f_init,c, 2·2·B·D·H (constant input: 1× backward);
    - every step: Σ_i α_ti a_i, 2·B·L·D (constant a: 1× backward); W_h h, 2·B·H·A; the score w·σ(·), 2·B·L·A;
      the gate w_β h, 2·B·H; the LSTM, 2·B·(E + D)·4H + 2·B·H·4H (2× backward);
    - all steps at once: the deep output L_h h_t + L_z z_t, 2·B·S·(H + D)·E, and L_o, 2·B·S·E·V (2× backward).

    Embedding look-ups, element-wise work, the softmax, the loss and Adam are not products and are not counted
    (as torch's FlopCounterMode does not count them). ``recurrent`` is the part computed step by step, in
    products of only B rows; ``batched`` the part computed over all images or all steps at once.
    """
    b, locations, d, width, s = shape.batch, shape.locations, shape.dim, shape.width, shape.length + 1
    e = h = a = width
    constant = {"W_a a_i": 2 * b * locations * d * a, "f_init,h and f_init,c": 2 * 2 * b * d * h,
                "Σ_i α_ti a_i": s * 2 * b * locations * d}
    trained = {"W_h h_t-1": s * 2 * b * h * a, "score w·σ": s * 2 * b * locations * a, "gate w_β": s * 2 * b * h,
               "LSTM": s * (2 * b * (e + d) * 4 * h + 2 * b * h * 4 * h),
               "deep output L_h, L_z": 2 * b * s * (h + d) * e, "L_o": 2 * b * s * e * shape.vocab}
    parts = {name: 2 * flops for name, flops in constant.items()} | {name: 3 * flops for name, flops in trained.items()}
    forward = sum(constant.values()) + sum(trained.values())
    recurrent = sum(parts[name] for name in ("Σ_i α_ti a_i", "W_h h_t-1", "score w·σ", "gate w_β", "LSTM"))
    total = sum(parts.values())
    return {"total": float(total), "forward": float(forward), "backward": float(total - forward),
            "recurrent": float(recurrent), "batched": float(total - recurrent),
            "parts": {name: float(flops) for name, flops in parts.items()}}


def counted_flops(run: Callable[[], Any]) -> float:
    """The matrix-product FLOPs torch's FlopCounterMode counts over one call of ``run``."""
    with FlopCounterMode(display=False) as counter:
        run()
    return float(counter.get_total_flops())


def step_inputs(shape: Shape) -> tuple[Tensor, Tensor]:
    """Random annotation vectors (B, L, D) and captions (B, T + 2), <start> w.. <end> <pad>.., one of them T words
    long, so that every model decodes the same T + 1 steps."""
    generator = torch.Generator().manual_seed(0)
    annotations = torch.randn(shape.batch, shape.locations, shape.dim, generator=generator)
    captions, lengths = random_captions(shape.batch, shape.length, shape.vocab, generator)
    if lengths.max() < shape.length + 2:
        captions[0, 1:-1] = torch.randint(4, shape.vocab, (shape.length,), generator=generator)
        captions[0, -1] = END_ID
    return annotations, captions


def our_decoder(shape: Shape, device: torch.device | None = None, *, compile_mode: str | None = None,
                train: bool = True) -> AttentionDecoder:
    """Our decoder at ``shape``'s widths, seeded, on ``device``, in training (``train``) or eval mode; through
    ``decoder.compile`` in ``compile_mode`` if given."""
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=shape.vocab, annotation_dim=shape.dim, embed_dim=shape.width,
                               hidden_dim=shape.width, attention_dim=shape.width, dropout=0.5).to(device)
    decoder.train(train)
    if compile_mode:
        compile_decoder(decoder, compile_mode)
    return decoder


def our_step(shape: Shape, annotations: Tensor, captions: Tensor, *, compiled: bool = False) -> Callable[[], None]:
    """One train step of our decoder at ``shape`` (Adam; through ``decoder.compile``'s default mode if
    ``compiled``)."""
    decoder = our_decoder(shape, compile_mode="default" if compiled else None)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=4e-4)
    return lambda: decoder_train_step(decoder, optimizer, annotations, captions)


def git_directory(path: Path) -> Path | None:
    """``path`` (or its ``repo`` folder, as a mirror keeps it) when git reads it as a repository, else None."""
    for candidate in (path, path / "repo"):
        done = subprocess.run(["git", f"--git-dir={candidate}", "rev-parse", "HEAD"], capture_output=True, text=True)
        if candidate.is_dir() and done.returncode == 0:
            return candidate
    return None


def extract_peer(source: Path, into: Path) -> str:
    """Copy ``PEER_FILES`` and ``PEER_LOSSES`` from the snapshot ``source`` (a checkout, or a git directory: its
    HEAD) to ``into``/``PEER_PACKAGE``, with empty ``__init__.py`` files (theirs import every model and its
    dependencies); return the snapshot's commit, or "checkout" for a checkout outside git."""
    if not source.exists():
        raise FileNotFoundError(f"--ruotianluo {source}: no such folder (a snapshot of ImageCaptioning.pytorch)")
    wanted = (*PEER_FILES, PEER_LOSSES)
    checkout = source.is_dir() and all((source / name).is_file() for name in wanted)
    git_dir = None if checkout else git_directory(source)
    if not checkout and git_dir is None:
        raise ValueError(f"--ruotianluo {source}: neither a checkout holding {PEER_FILES[0]} nor a git directory")
    for name in wanted:
        target = into / PEER_PACKAGE / Path(name).relative_to("captioning")
        target.parent.mkdir(parents=True, exist_ok=True)
        for package in (target.parent, target.parent.parent):
            (package / "__init__.py").touch()
        if checkout:
            shutil.copyfile(source / name, target)
            continue
        shown = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"HEAD:{name}"], capture_output=True)
        if shown.returncode:
            raise ValueError(f"--ruotianluo {source}: its HEAD has no {name}")
        target.write_bytes(shown.stdout)
    if checkout:  # its COMMIT file (scripts/gpu_check_prepare.sh writes one), else its own git's HEAD
        if (source / "COMMIT").is_file():
            return (source / "COMMIT").read_text().strip()
        done = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel", "HEAD"],
                              capture_output=True, text=True)
        lines = done.stdout.split()
        own = done.returncode == 0 and Path(lines[0]).resolve() == source.resolve()
        return lines[1] if own else "checkout"
    return subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def load_peer(source: Path) -> SimpleNamespace:
    """Their model classes (``PEER_MODELS``) and ``LanguageModelCriterion``, imported from a temporary copy of
    ``source``, and the snapshot's ``commit``. ``misc.py`` imports ``six`` (for Python 2) at the top and uses
    it only to read pickles; where it is not installed, a two-line stand-in in the temporary folder gives it
    ``PY3`` and ``moves.cPickle``."""
    with tempfile.TemporaryDirectory(prefix="peer_captioning_") as folder:
        root = Path(folder)
        commit = extract_peer(source, root)
        stand_in = importlib.util.find_spec("six") is None
        if stand_in:
            (root / "six").mkdir()
            (root / "six" / "__init__.py").write_text("PY3 = True\n")
            (root / "six" / "moves.py").write_text("import pickle as cPickle  # noqa: F401\n")
        sys.path.insert(0, folder)
        try:
            models = importlib.import_module(f"{PEER_PACKAGE}.models.AttModel")
        except ImportError as error:
            raise ValueError(f"--ruotianluo {source}: importing its AttModel.py failed: {error}") from None
        finally:
            sys.path.remove(folder)
            if stand_in:  # their misc.py keeps it; nothing else in this process sees it
                sys.modules.pop("six.moves", None)
                sys.modules.pop("six", None)
        losses = (root / PEER_PACKAGE / "modules" / "losses.py").read_text()
        tree = ast.parse(losses)
        found = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LanguageModelCriterion"]
        if not found:
            raise ValueError(f"--ruotianluo {source}: {PEER_LOSSES} has no LanguageModelCriterion")
        namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F}
        exec(compile(ast.Module(body=found, type_ignores=[]), PEER_LOSSES, "exec"), namespace)
    classes = {name: getattr(models, PEER_MODELS[name]) for name in PEER_MODELS}
    return SimpleNamespace(commit=commit, criterion=namespace["LanguageModelCriterion"], **classes)


def peer_options(shape: Shape) -> SimpleNamespace:
    """Their ``opt`` (the fields of ``captioning/utils/opts.py`` that AttModel reads, defaults aside from the
    widths): the same widths as ours, ``vocab_size`` one less than ours, as their id 0 (<bos>, <eos> and <pad>)
    comes on top, so both output layers have ``shape.vocab`` words."""
    return SimpleNamespace(vocab_size=shape.vocab - 1, input_encoding_size=shape.width, rnn_size=shape.width,
                           num_layers=1, drop_prob_lm=0.5, max_length=shape.length, seq_length=shape.length,
                           fc_feat_size=shape.dim, att_feat_size=shape.dim, att_hid_size=shape.width, logit_layers=1,
                           use_bn=0, vocab={str(i): f"w{i}" for i in range(1, shape.vocab)})


def peer_step(peer: SimpleNamespace, name: str, shape: Shape, annotations: Tensor, captions: Tensor, *,
              device: torch.device | None = None) -> Callable[[], None]:
    """One train step of their model ``name`` on our inputs, as their LossWrapper takes it without self-critical
    training: labels with our <start>, <end> and <pad> all their 0, the mask over the words and the <end>,
    ``fc_feats`` the mean annotation vector (Att2in2 and Att2in do not read it); on ``device`` if given (the
    inputs' already)."""
    torch.manual_seed(0)
    model = getattr(peer, name)(peer_options(shape)).to(device).train()
    criterion = peer.criterion()
    optimizer = torch.optim.Adam(model.parameters(), lr=4e-4)
    special = (captions == START_ID) | (captions == END_ID) | (captions == PAD_ID)
    labels = captions.masked_fill(special, 0)
    masks = (captions != PAD_ID).float()
    fc_feats = annotations.mean(dim=1)

    def step() -> None:
        loss = criterion(model(fc_feats, annotations, labels[:, :-1]), labels[:, 1:], masks[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def matmul_runs(shape: Shape) -> tuple[dict[str, Callable[[], Any]], dict[str, float]]:
    """Two products timed in the same turns as the steps, with their FLOPs: the 2048³ fp32 peak, and the LSTM's
    per-step input product, (B, E + D) by (E + D, 4H)."""
    generator = torch.Generator().manual_seed(1)
    big = [torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator) for _ in range(2)]
    inner = shape.width + shape.dim
    rows = torch.randn(shape.batch, inner, generator=generator)
    weight = torch.randn(inner, 4 * shape.width, generator=generator)
    runs = {"matmul_2048": lambda: big[0] @ big[1], "matmul_lstm_step": lambda: rows @ weight}
    return runs, {"matmul_2048": 2.0 * MATMUL_SIZE**3, "matmul_lstm_step": 2.0 * shape.batch * inner * 4 * shape.width}


def measure(shape: Shape, *, peer_source: Path | None = None, models: tuple[str, ...] = tuple(PEER_MODELS),
            repeats: int = 5, compiled: bool = True) -> dict[str, Any]:
    """Time our step (eager, and compiled if ``compiled``), their ``models`` (with ``peer_source``) and the two
    products of ``matmul_runs`` in turns; count FLOPs; return the figures and the markdown table."""
    peer = load_peer(peer_source) if peer_source is not None else None
    annotations, captions = step_inputs(shape)
    analytic = decoder_matmul_flops(shape)
    runs: dict[str, Callable[[], Any]] = {"ours": our_step(shape, annotations, captions)}
    results: dict[str, Any] = {"shape": asdict(shape), "decoding_steps": shape.length + 1, "flops": analytic,
                               "peer": None if peer is None else {"source": str(peer_source), "commit": peer.commit}}
    counted = {"ours": counted_flops(runs["ours"])}
    if compiled:
        step = our_step(shape, annotations, captions, compiled=True)
        started = time.perf_counter()
        try:
            step()  # compiles: the first call
            runs["ours_compiled"] = step
            results["ours_compiled_first_step_s"] = time.perf_counter() - started
        except Exception as error:  # no C compiler, an inductor limit: reported, the rest still measured
            results["ours_compiled_error"] = " ".join(f"{type(error).__name__}: {error}".split())[:300]
    for name in models if peer is not None else ():
        runs[name] = peer_step(peer, name, shape, annotations, captions)
        counted[name] = counted_flops(runs[name])
    products, product_flops = matmul_runs(shape)
    timed = paired_median_seconds(runs | products, repeats=repeats, warmup=1)
    rates = {name: product_flops[name] / timed[name] / 1e9 for name in products}
    peak = rates["matmul_2048"]
    results["matmul_gflops_per_s"] = peak
    results["lstm_step_matmul_gflops_per_s"] = rates["matmul_lstm_step"]
    results["steps"] = {}
    for name in runs:
        flops = analytic["total"] if name.startswith("ours") else counted[name]
        results["steps"][name] = {"seconds": timed[name], "captions_per_s": shape.batch / timed[name],
                                  "matmul_flops": flops, "counted_flops": counted.get(name),
                                  "gflops_per_s": flops / timed[name] / 1e9,
                                  "share_of_matmul": flops / timed[name] / 1e9 / peak}
        if name in PEER_MODELS:
            results["steps"][name]["ours_speedup"] = timed[name] / timed["ours"]
            if "ours_compiled" in runs:
                results["steps"][name]["ours_compiled_speedup"] = timed[name] / timed["ours_compiled"]
    results["table"] = markdown_table(table_rows(shape, results))
    return results


def table_rows(shape: Shape, results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The table's rows (what, figure, goal) from ``measure``'s figures."""
    steps, flops, peak = results["steps"], results["flops"], results["matmul_gflops_per_s"]
    setting = (f"B={shape.batch}, L={shape.locations}, D={shape.dim}, widths {shape.width}, T={shape.length}, "
               f"{shape.vocab} words")
    lstm = results["lstm_step_matmul_gflops_per_s"]
    rows = [(f"fp32 matmul rate, {MATMUL_SIZE}³ / the LSTM's per-step product "
             f"({shape.batch}×{shape.width + shape.dim}×{4 * shape.width})",
             f"{peak:.0f} / {lstm:.1f} GFLOP/s ({lstm / peak:.0%})", "report")]
    ours = steps["ours"]
    rows.append((f"our train step ({setting})", f"{ours['seconds']:.3f} s, {ours['captions_per_s']:.1f} captions/s",
                 "report"))
    rows.append(("our step's matmul FLOPs, by hand / torch's FlopCounterMode; share computed step by step",
                 f"{flops['total'] / 1e9:.2f} / {ours['counted_flops'] / 1e9:.2f} GFLOP; "
                 f"{flops['recurrent'] / flops['total']:.0%}", "report"))
    rows.append(("our step: achieved / fp32 matmul rate", f"{ours['gflops_per_s']:.1f} / {peak:.0f} GFLOP/s = "
                 f"{ours['share_of_matmul']:.0%}", "≥ 60%"))
    if "ours_compiled" in steps:
        compiled = steps["ours_compiled"]
        rows.append(("our step compiled (decoder.compile): achieved / fp32 matmul rate",
                     f"{compiled['seconds']:.3f} s ({ours['seconds'] / compiled['seconds']:.2f}× eager; first step "
                     f"{results['ours_compiled_first_step_s']:.0f} s); {compiled['gflops_per_s']:.1f} / {peak:.0f} "
                     f"GFLOP/s = {compiled['share_of_matmul']:.0%}", "≥ 60%"))
    elif "ours_compiled_error" in results:
        rows.append(("our step compiled (decoder.compile)", f"did not run: {results['ours_compiled_error']}",
                     "≥ 60%"))
    for name in PEER_MODELS:
        if name in steps:
            theirs = steps[name]
            also = f"; compiled {theirs['ours_compiled_speedup']:.2f}×" if "ours_compiled_speedup" in theirs else ""
            rows.append((f"train step, ours vs ruotianluo's {PEER_NAMES[name]} (their matmul share "
                         f"{theirs['share_of_matmul']:.0%})",
                         f"{ours['captions_per_s']:.1f} vs {theirs['captions_per_s']:.1f} captions/s "
                         f"({theirs['ours_speedup']:.2f}×{also})", PEER_GOALS[name]))
    if results["peer"] is None:
        rows.append(("ruotianluo/ImageCaptioning.pytorch", "not measured: give --ruotianluo PATH", "≥ 1.5×"))
    return rows


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.peers``: parse, check the paths before any work, measure, print, write JSON."""
    parser = OneLineParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--ruotianluo", type=Path, default=None,
                        help="a snapshot of ruotianluo/ImageCaptioning.pytorch: a git directory or a checkout "
                             "(without it, only our side is measured)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (B=4, L=9, widths 16, 50 words, T=5): "
                                                            "a smoke test, not a measurement")
    default = Shape()
    for field, value in asdict(default).items():
        parser.add_argument(f"--{field}", type=at_least(1, SIZE_LIMITS[field]), default=None,
                            help=f"default {value} (the paper's), at most {SIZE_LIMITS[field]}")
    parser.add_argument("--models", nargs="+", choices=list(PEER_MODELS), default=list(PEER_MODELS),
                        help="their models to time (default all)")
    parser.add_argument("--repeats", type=at_least(1, 1000), default=5, help="timed turns (default 5)")
    parser.add_argument("--threads", type=at_least(1, 1024), default=2, help="torch threads (default 2)")
    parser.add_argument("--out", default="peers.json", help="where to write the JSON (default peers.json)")
    options = parser.parse_args(argv)
    with exit_on_user_error():
        out = output_file(options.out)
        if options.ruotianluo is not None and not options.ruotianluo.exists():
            raise FileNotFoundError(f"--ruotianluo {options.ruotianluo}: no such folder")
        base = TINY if options.tiny else default
        shape = Shape(**{field: getattr(options, field) or value for field, value in asdict(base).items()})
        threads = torch.get_num_threads()
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if step_memory_bytes(shape) > available // 4:
            raise ValueError(f"--batch, --locations, --width, --vocab, --length: a step at {shape} needs about "
                             f"{step_memory_bytes(shape) / 2**30:.1f} GiB, over a quarter of this machine's "
                             f"{available / 2**30:.0f} GiB; choose a smaller shape")
        torch.set_num_threads(options.threads)
        try:
            results = measure(shape, peer_source=options.ruotianluo, models=tuple(options.models),
                              repeats=options.repeats, compiled=False)  # on CPUs decoder.compile runs eager
        finally:
            torch.set_num_threads(threads)  # as it was: a caller in the same process keeps its own
        results["machine"] = {"cpu": cpu_description(), "threads": options.threads,
                              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        print(results["table"])
        write_json_atomically(out, results)
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
