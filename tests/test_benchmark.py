"""The benchmark runs end to end with tiny sizes (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json

import torch

from vision_attn.benchmark import TutorialStyleDecoder, main, random_captions


def test_quick_benchmark_prints_the_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("| what | figure | goal |")
    results = json.loads(out.read_text())
    assert {"vocabulary", "captioner_train_step", "beam_search_k5", "machine", "table"} <= set(results)
    assert results["vocabulary"]["captions"] == 20000 and results["vocabulary"]["total_s"] > 0
    assert all(row["speedup"] > 0 for row in results["captioner_train_step"])


def test_reference_decoder_predicts_every_real_step() -> None:
    generator = torch.Generator().manual_seed(0)
    captions, lengths = random_captions(4, 6, 50, generator)
    reference = TutorialStyleDecoder(vocab_size=50, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7)
    predictions, sorted_captions, decode_lengths = reference(torch.randn(4, 9, 8), captions, lengths)
    assert decode_lengths == sorted(decode_lengths, reverse=True) == sorted((lengths - 1).tolist(), reverse=True)
    for row, steps in enumerate(decode_lengths):
        assert predictions[row, :steps].abs().sum(-1).gt(0).all()  # every real step predicted
        assert predictions[row, steps:].abs().sum() == 0  # nothing past the caption's end
