"""Refactors keep behaviour: the tiny configs train to the same weights and test to the same metrics, to the
last digit, as when ``tests/pinned_metrics.json`` was written (a metric added since is not compared until the
figures are written again).

The figures depend on the CPU's floating-point kernels, so they are pinned per kind of machine: exactly on
the kinds that wrote them (AMD's x86 with AVX-512, Intel's with AVX-512 and AMX), and to 1e-4 relative
elsewhere, where the kernels round differently but a change of behaviour still shows. A kind holds only the
cases written on it since their code last changed its rounding; the others are compared with another kind's
figures, to 1e-4. ``VISION_ATTN_PIN=write`` records this machine's figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import printed_metrics, tiny
from vision_attn.cli import main
from vision_attn.hardware import cpu_flags

PINNED = Path(__file__).parent / "pinned_metrics.json"


def machine_kind() -> str:
    """The kind of CPU whose rounding the pinned figures hold: its architecture, vendor (MKL and oneDNN choose
    their kernels by vendor too), AVX-512 and AMX or not, and the thread count."""
    vendor = ""
    if Path("/proc/cpuinfo").is_file():
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        vendor = next((line.split(":")[1].strip() for line in lines if line.startswith("vendor_id")), "")
    flags = cpu_flags()  # less the kernels torch and oneDNN were told not to use (scripts/slower_cpu.sh)
    isa = "".join(name for flag, name in (("avx512f", "-avx512"), ("amx_tile", "-amx")) if flag in flags)
    return f"{os.uname().machine}{'-' + vendor if vendor else ''}{isa}-threads{torch.get_num_threads()}"


def weights_checksum(checkpoint: Path) -> float:
    """Σ|w| over every tensor of the checkpoint's weights, per tensor sums added in sorted order (so renaming or
    regrouping the modules changes nothing, but any change to a trained value does)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    sums = sorted(float(tensor.double().abs().sum()) for tensor in state.values() if tensor.is_floating_point())
    return sum(sums)


def fit_and_test(config: str, tmp_path: Path, capsys: pytest.CaptureFixture, *extra: str) -> dict[str, float]:
    run = tmp_path / "run"
    main(["fit", *tiny(config), "--trainer.default_root_dir", str(run), *extra])
    checkpoint = next(run.rglob("best.ckpt"))
    capsys.readouterr()
    main(["test", *tiny(config), "--ckpt_path", str(checkpoint),
          "--trainer.default_root_dir", str(tmp_path / "test"), *extra])
    figures = {name: float(value) for name, value in printed_metrics(capsys.readouterr().out).items()}
    assert figures, "the test run printed no test metrics"
    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    best = next(state["best_model_score"] for key, state in loaded["callbacks"].items() if "ModelCheckpoint" in key)
    figures["best_model_score"] = float(best)
    figures["weights_abs_sum"] = weights_checksum(checkpoint)
    results = list((tmp_path / "test").rglob("results_test.json"))
    if results:  # the captioner's results records: every word and every α, position-weighted
        records = json.loads(results[0].read_text())
        figures["results_alpha_checksum"] = sum(
            (t + 1) * (i + 1) * alpha for record in records for t, row in enumerate(record["alphas"])
            for i, alpha in enumerate(row))
        figures["results_words"] = float(sum(len(record["tokens"]) for record in records))
    return figures


CASES = {
    "captioner_tiny": ("captioner_tiny.yaml",),
    "captioner_tiny_hard": ("captioner_tiny.yaml", "--model.init_args.decoder.attention_mode", "hard"),
    "captioner_tiny_self_critical": ("captioner_tiny.yaml", "--model.init_args.self_critical.from_epoch", "0",
                                     "--model.init_args.self_critical.samples", "2",
                                     "--data.init_args.group_captions", "true"),
    "vit_tiny": ("vit_tiny.yaml",),
    "vit_tiny_patch_drop": ("vit_tiny.yaml", "--model.init_args.training.patch_drop_rate", "0.5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_config_metrics_are_pinned(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config, *extra = CASES[case]
    extra = list(extra)
    if config.startswith("captioner"):
        extra += ["--data.init_args.root", str(tmp_path / "scenes")]
    figures = fit_and_test(config, tmp_path, capsys, *extra)
    kind = machine_kind()
    pinned = json.loads(PINNED.read_text()) if PINNED.is_file() else {}
    if os.environ.get("VISION_ATTN_PIN") == "write":
        pinned.setdefault(kind, {})[case] = figures
        PINNED.write_text(json.dumps(pinned, indent=2, sort_keys=True) + "\n")
        pytest.skip(f"wrote the figures of {case} for {kind}")
    exact = pinned.get(kind, {}).get(case)
    reference = exact or next(cases[case] for cases in pinned.values() if case in cases)
    assert reference.keys() <= figures.keys()  # a metric added since the pin is new, not changed: not compared
    figures = {name: figures[name] for name in reference}
    if exact:
        assert figures == reference
    else:  # another kind of machine: its kernels round differently; behaviour changes are far larger than this
        for name, value in reference.items():
            assert figures[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
