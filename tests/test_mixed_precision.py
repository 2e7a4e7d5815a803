"""Mixed precision on the CPU: both models' numbers under autocast against fp32, a bf16-mixed fit of each model
through the CLI, and the captioner's test, `caption` and `overlay` from the bf16-trained checkpoint."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process, tiny
from tests.test_captioner_model import captions_batch, tiny_decoder
from vision_attn.captioning import fast_additive
from vision_attn.captioning.beam_search import beam_search
from vision_attn.cli import main
from vision_attn.hardware import bf16_warning
from vision_attn.vit.vision_transformer import VisionTransformer

# bf16 keeps 8 bits of mantissa (relative error up to 2^-8 per rounding), fp16 11 bits
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("coverage", [False, True], ids=["plain", "coverage"])
def test_the_decoder_under_autocast_gives_fp32_alphas_betas_and_word_log_probs(dtype, coverage) -> None:
    decoder = tiny_decoder(coverage=coverage)
    annotations = torch.randn(2, 9, 8)
    reference = decoder(annotations, captions_batch())
    with torch.autocast("cpu", dtype=dtype):
        mixed = decoder(annotations, captions_batch())
    tolerance = TOLERANCE[dtype]
    assert mixed.logits.dtype == dtype  # autocast really ran the projections in low precision
    torch.testing.assert_close(mixed.alphas.float(), reference.alphas, atol=tolerance, rtol=0)
    torch.testing.assert_close(mixed.betas.float(), reference.betas, atol=tolerance, rtol=0)
    torch.testing.assert_close(mixed.logits.float().log_softmax(-1), reference.logits.log_softmax(-1),
                               atol=5 * tolerance, rtol=0)
    mixed.logits.float().sum().backward()  # the backward runs through the in-place σ too
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in decoder.parameters())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunked_coverage_attention_under_autocast_reuses_a_buffer_of_the_right_dtype(dtype, monkeypatch) -> None:
    """The no-grad path writes σ(2x) into one reused buffer: under autocast W_h h, w_c c and W_a a arrive in
    low precision while c_t may be fp32, and the buffer must take their dtype."""
    monkeypatch.setattr(fast_additive, "CHUNK_ELEMENTS", 2**10)  # force many chunks
    decoder = tiny_decoder(coverage=True)
    annotations, hidden, coverage = torch.randn(50, 9, 8), torch.randn(150, 10), torch.rand(150, 9)
    term = decoder.attention_inputs.coverage.term(coverage, None)
    with torch.no_grad():
        reference = decoder.attention(decoder.attention.keys(annotations), hidden, (), [term]).alpha
        with torch.autocast("cpu", dtype=dtype):
            mixed = decoder.attention(decoder.attention.keys(annotations), hidden, (), [term]).alpha
    torch.testing.assert_close(mixed.float(), reference, atol=TOLERANCE[dtype], rtol=0)


def test_beam_search_under_autocast_finds_the_fp32_captions() -> None:
    decoder = tiny_decoder(coverage=True).eval()
    with torch.no_grad():  # sharpen the word scores, so that bf16 rounding cannot swap two candidates
        decoder.output_words.weight.mul_(20.0)
    annotations = torch.randn(4, 9, 8)
    options = {"start_id": 1, "end_id": 2, "beam_size": 3, "max_length": 6}
    with torch.no_grad():
        reference = beam_search(decoder, annotations, **options)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = beam_search(decoder, annotations, **options)
    assert [[h.tokens for h in beams] for beams in mixed] == [[h.tokens for h in beams] for beams in reference]
    for got, want in zip(mixed, reference, strict=True):
        torch.testing.assert_close(got[0].alphas.float(), want[0].alphas, atol=3e-2, rtol=0)
        assert got[0].score == pytest.approx(want[0].score, abs=0.1)


def test_the_vit_under_bf16_autocast_gives_fp32_logits_and_attention() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                              num_heads=2).eval()
    images = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        logits, attentions = model.forward_with_attention(images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed_logits, mixed_attentions = model.forward_with_attention(images)
    assert mixed_logits.dtype == torch.bfloat16
    torch.testing.assert_close(mixed_logits.float(), logits, atol=0.1, rtol=0.05)
    for got, want in zip(mixed_attentions, attentions, strict=True):
        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)


def test_bf16_warns_only_on_a_cpu_without_bf16_arithmetic() -> None:
    avx2 = {"fpu", "sse2", "avx2", "fma"}
    message = bf16_warning("bf16-mixed", True, avx2)
    assert message is not None and "avx512_bf16" in message and "--trainer.precision 32-true" in message
    assert "\n" not in message
    assert bf16_warning("bf16-true", True, avx2) is not None
    assert bf16_warning("bf16-mixed", True, avx2 | {"avx512_bf16"}) is None
    assert bf16_warning("bf16-mixed", True, avx2 | {"amx_bf16"}) is None
    assert bf16_warning("32-true", True, avx2) is None
    assert bf16_warning("bf16-mixed", False, avx2) is None  # a GPU has its own bf16 units
    assert bf16_warning("bf16-mixed", True, set()) is None  # flags unknown (no /proc/cpuinfo): no guess


def _train_losses(run: Path) -> list[float]:
    rows = list(csv.DictReader(next(run.rglob("metrics.csv")).open()))
    return [float(row["train/loss"]) for row in rows if row.get("train/loss")]


@pytest.mark.heavy
def test_the_captioner_trains_in_bf16_mixed_and_its_checkpoint_tests_captions_and_overlays(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("vision_attn.trainer_cli.cpu_flags", lambda: {"sse2", "avx2"})  # a CPU without bf16
    scenes, run = tmp_path / "scenes", tmp_path / "run"
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(scenes),
              "--trainer.precision", "bf16-mixed"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["fit", *common, "--trainer.max_epochs", "10", "--trainer.log_every_n_steps", "1",
              "--trainer.check_val_every_n_epoch", "10",
              "--model.init_args.optimiser.lr", "0.01", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
              "--trainer.logger.save_dir", str(run), "--trainer.default_root_dir", str(run)])
    said = [str(w.message) for w in caught if "without bf16 arithmetic" in str(w.message)]
    assert len(said) == 1, said  # one warning at start-up, not one per step
    losses = _train_losses(run)
    assert len(losses) == 30 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses  # the loss falls
    checkpoint = next(run.rglob("last.ckpt"))
    assert torch.load(checkpoint, weights_only=True)["hyper_parameters"]["vocabulary"]

    tested = run_in_process("test", *common, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir",
                        str(tmp_path / "test"))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "test/CIDEr-D" in tested.stdout and "test/pointing_words" in tested.stdout
    assert len(json.loads((tmp_path / "test" / "results_test.json").read_text())) == 6  # beam search ran
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (96, 96), (200, 30, 30)).save(images / "red.png")
    Image.new("L", (50, 120), 90).save(images / "grey.png")
    out = tmp_path / "captions.json"
    captioned = run_in_process("caption", "--ckpt", str(checkpoint), str(images), "--out", str(out))
    assert captioned.returncode == 0, captioned.stderr[-3000:]
    records = json.loads(out.read_text())
    assert len(records) == 2 and all(abs(sum(row) - 1) < 1e-3 for r in records for row in r["alphas"])
    overlaid = run_in_process("overlay", "--ckpt", str(checkpoint), str(images), "--out", str(tmp_path / "overlays"))
    assert overlaid.returncode == 0, overlaid.stderr[-3000:]
    assert len(list((tmp_path / "overlays").glob("*.png"))) == 2


def test_the_vit_trains_in_bf16_mixed(tmp_path) -> None:
    run = tmp_path / "run"
    main(["fit", *tiny("vit_tiny.yaml"), "--trainer.precision", "bf16-mixed",
          "--trainer.limit_train_batches", "60", "--trainer.log_every_n_steps", "1",
          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(run),
          "--trainer.default_root_dir", str(run)])
    losses = _train_losses(run)
    assert len(losses) == 60 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-10:]) / 10 < math.log(10) - 0.2, losses  # below chance (ln 10 for 10 classes)


def test_cpu_flags_leave_out_the_kernels_torch_and_onednn_were_told_not_to_use(monkeypatch) -> None:
    """Under ATEN_CPU_CAPABILITY=avx2 or ONEDNN_MAX_CPU_ISA=AVX2 (scripts/slower_cpu.sh) an AVX-512 machine runs
    AVX2 kernels: bf16 is emulated there, so its flags must not claim AVX-512 or bf16 arithmetic."""
    from vision_attn.hardware import cpu_flags

    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    everything = cpu_flags()
    for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        monkeypatch.setenv(name, value)
        limited = cpu_flags()
        assert limited <= everything and not any(flag.startswith(("avx512", "amx")) for flag in limited)
        assert everything - limited == {flag for flag in everything if flag.startswith(("avx512", "amx"))}
        monkeypatch.delenv(name)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert cpu_flags() == everything - {"avx512_bf16"} - {flag for flag in everything if flag.startswith("amx")}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert cpu_flags() == everything
