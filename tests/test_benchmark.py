"""The benchmark runs end to end with tiny sizes (a smoke test: no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.reference_decoder import TutorialStyleDecoder
from benchmarks.run import main, random_captions
from vision_attn.data.vocabulary import PAD_ID


@pytest.mark.heavy
def test_quick_benchmark_prints_the_table_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    main(["--quick", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("| what | figure | goal |")
    results = json.loads(out.read_text())
    sections = {"vit_vs_timm", "utilisation", "captioner_train_step", "captioner_growth", "captioner_resnet50_step",
                "beam_search", "vocabulary", "image_decode", "feature_cache", "machine", "table"}
    assert sections <= set(results)
    assert results["vocabulary"]["captions"] == 20000 and results["vocabulary"]["total_s"] > 0
    assert all(row["speedup"] > 0 for row in results["captioner_train_step"])
    for figures in results["vit_vs_timm"].values():
        assert figures["train_ratio"] > 0 and figures["attention_maps_time_ratio"] > 0
    assert 0 < results["utilisation"]["fraction"] and "FLOPs =" in results["utilisation"]["formula"]
    assert set(results["beam_search"]) == {"1", "3"}
    cache = results["feature_cache"]
    assert cache["speedup"] > 0 and cache["encoder_gflops_per_image"] > 0
    stored = 2 * cache["shape"][0] * cache["shape"][1] * cache["shape"][2]  # fp16 values per image
    assert stored <= cache["disk_bytes_per_image"] < stored + 100  # the rest: .npy headers and the valid flag
    assert printed.count("\n| ") >= 17  # one row per measurement


def test_vit_flops_formula_matches_a_count_by_hand() -> None:
    from benchmarks.run import vit_forward_flops

    # One block, 2x2 patches of 4 px, 1 channel, D=8, 3 classes: N = 5 tokens.
    embedding = 2 * 4 * 16 * 1 * 8  # 4 patches, each a 16-pixel dot product per output channel
    qkv, proj, mlp = 2 * 5 * 8 * 24, 2 * 5 * 8 * 8, 2 * 5 * 8 * 32 * 2
    scores_and_mix = 2 * 2 * 5 * 5 * 8
    head = 2 * 8 * 3
    assert vit_forward_flops(img_size=8, patch_size=4, in_chans=1, embed_dim=8, depth=1, num_classes=3) == \
        embedding + qkv + proj + mlp + scores_and_mix + head


def test_reference_decoder_predicts_every_real_step() -> None:
    generator = torch.Generator().manual_seed(0)
    captions, lengths = random_captions(4, 6, 50, generator)
    reference = TutorialStyleDecoder(vocab_size=50, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7)
    predictions, sorted_captions, decode_lengths = reference(torch.randn(4, 9, 8), captions, lengths)
    assert decode_lengths == sorted(decode_lengths, reverse=True) == sorted((lengths - 1).tolist(), reverse=True)
    for row, steps in enumerate(decode_lengths):
        assert predictions[row, :steps].abs().sum(-1).gt(0).all()  # every real step predicted
        assert predictions[row, steps:].abs().sum() == 0  # nothing past the caption's end


@pytest.mark.parametrize("sizes", [dict(), dict(dim=24, width=16, vocab=37, length=7, batch=3, locations=7)])
def test_peer_benchmark_counts_our_step_as_torch_does(sizes) -> None:
    """The decoder's matmul FLOPs counted by hand agree with torch's FlopCounterMode over a whole train step."""
    from benchmarks.peers import TINY, Shape, counted_flops, decoder_matmul_flops, our_step, step_inputs

    shape = Shape(**sizes) if sizes else TINY
    annotations, captions = step_inputs(shape)
    assert captions.ne(PAD_ID).sum(1).max() == shape.length + 2  # one caption as long as can be: T + 1 steps
    by_hand = decoder_matmul_flops(shape)
    assert by_hand["total"] == pytest.approx(counted_flops(our_step(shape, annotations, captions)), rel=0.01)
    assert by_hand["recurrent"] + by_hand["batched"] == by_hand["forward"] + by_hand["backward"] == by_hand["total"]


def test_peer_benchmark_runs_our_side_without_the_snapshot(tmp_path, capsys) -> None:
    from benchmarks.peers import main as peers_main

    out = tmp_path / "peers.json"
    threads = torch.get_num_threads()
    peers_main(["--tiny", "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert torch.get_num_threads() == threads  # restored for the rest of the process
    printed = capsys.readouterr().out
    assert printed.startswith("| what | figure | goal |") and "not measured: give --ruotianluo PATH" in printed
    results = json.loads(out.read_text())
    ours = results["steps"]["ours"]
    assert set(results["steps"]) == {"ours"} and results["peer"] is None
    assert ours["matmul_flops"] == results["flops"]["total"] == pytest.approx(ours["counted_flops"], rel=0.02)
    assert ours["seconds"] > 0 and 0 < ours["share_of_matmul"] == pytest.approx(
        ours["matmul_flops"] / ours["seconds"] / 1e9 / results["matmul_gflops_per_s"])
    assert results["shape"]["batch"] == 4 and results["decoding_steps"] == 6


@pytest.mark.parametrize("kind", ["missing", "not_a_snapshot"])
def test_peer_benchmark_refuses_a_bad_snapshot_in_one_line(kind, tmp_path, capsys) -> None:
    from benchmarks.peers import main as peers_main

    snapshot = tmp_path / kind
    if kind == "not_a_snapshot":
        snapshot.mkdir()
    out = tmp_path / "peers.json"
    with pytest.raises(SystemExit) as exit_info:
        peers_main(["--tiny", "--ruotianluo", str(snapshot), "--out", str(out)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith(f"error: --ruotianluo {snapshot}")
    assert error.count("\n") == 1 and "Traceback" not in error and not out.exists()


def test_peer_benchmark_refuses_a_shape_too_large_for_memory_before_any_work(tmp_path, capsys) -> None:
    from benchmarks.peers import main as peers_main

    out = tmp_path / "peers.json"
    with pytest.raises(SystemExit) as exit_info:
        peers_main(["--batch", "1024", "--locations", "4096", "--width", "4096", "--out", str(out)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: --batch, --locations") and "GiB" in error
    assert error.count("\n") == 1 and not out.exists()


def test_fit_throughput_counts_the_epochs_after_the_first_less_their_validations() -> None:
    """Hand-made clocks: 2 later epochs of 10 s with 2 s of validation each, 100 steps of 64 captions, 0.8 s of
    loader waits: 12,800 captions in 16 s of training; validation per image from the later epochs only."""
    from benchmarks.fit_throughput import COCO_TRAIN_CAPTIONS, COCO_VAL_IMAGES, sustained

    steps = [{"epoch": epoch, "captions": 64, "wait": 0.008} for epoch in (0, 1, 2) for _ in range(100)]
    clock = {"steps": steps, "epochs": [{"epoch": 0, "seconds": 60.0}, {"epoch": 1, "seconds": 10.0},
                                        {"epoch": 2, "seconds": 10.0}],
             "validations": [{"epoch": 0, "seconds": 30.0, "sanity": False}, {"epoch": 1, "seconds": 2.0,
                                                                              "sanity": False},
                             {"epoch": 2, "seconds": 2.0, "sanity": False}, {"epoch": 0, "seconds": 9.0,
                                                                             "sanity": True}]}
    figures = sustained(clock, val_images=100)
    assert figures["steps"] == 200 and figures["captions"] == 12_800
    assert figures["captions_per_s"] == pytest.approx(800.0) and figures["mean_step_s"] == pytest.approx(0.08)
    assert figures["loader_share"] == pytest.approx(1.6 / 16) and figures["validation_s_per_image"] == 0.02
    assert figures["first_epoch_s"] == 60.0
    assert figures["coco_epoch_min"] == pytest.approx((COCO_TRAIN_CAPTIONS / 800 + COCO_VAL_IMAGES * 0.02) / 60)
    with pytest.raises(ValueError, match="--epochs 2 or more"):
        sustained({**clock, "epochs": clock["epochs"][:1]}, val_images=100)


@pytest.mark.heavy
def test_fit_throughput_fits_the_coco_recipe_on_coco_shaped_data_on_the_cpu(tmp_path, capsys) -> None:
    """The real command at a small size: the data it writes has COCO's caption counts and lengths, and the
    recipe's fit (its compiled decoder, eager on a CPU) runs two epochs under the clock."""
    from benchmarks.fit_throughput import main as fit_main
    from benchmarks.fit_throughput import write_coco_shaped

    counts = write_coco_shaped(tmp_path / "shape", train=40, val=2)
    entries = json.loads((tmp_path / "shape" / "dataset_coco.json").read_text())["images"]
    assert counts["train_images"] == 40 and len(entries) == 44
    assert {len(e["sentences"]) for e in entries} <= {5, 6, 7} and counts["train_captions"] >= 200
    assert {len(s["tokens"]) for e in entries for s in e["sentences"]} <= set(range(8, 23))
    out = tmp_path / "fit.json"
    fit_main(["--accelerator", "cpu", "--train-images", "4", "--val-images", "2", "--epochs", "2", "--batch-size",
              "2", "--workers", "0", "--min-word-count", "1", "--variants", "compiled reduce-overhead 32-true",
              "--work", str(tmp_path / "work"), "--out", str(out)])
    figures = json.loads(out.read_text())["variants"]["compiled reduce-overhead 32-true"]
    assert figures["steps"] == 2 and figures["captions"] >= 10 and figures["captions_per_s"] > 0
    assert "compiled reduce-overhead 32-true |" in capsys.readouterr().out


def test_the_gpu_peer_benchmark_refuses_a_machine_without_cuda_in_one_line(tmp_path, capsys) -> None:
    from benchmarks.peers_gpu import main as peers_gpu_main

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(SystemExit) as exit_info:
        peers_gpu_main(["--tiny", "--out", str(tmp_path / "p.json")])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: benchmarks.peers_gpu needs a CUDA GPU")
    assert error.count("\n") == 1 and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_gpu_peer_benchmark_runs_and_steps_our_side_on_the_cpu(precision) -> None:
    """Its train steps and beam searches, eager and through decoder.compile (eager on a CPU), run at the tiny
    shape in both precisions (a smoke test of the harness; scripts/gpu_check.sh times it on a GPU)."""
    from benchmarks.peers import TINY
    from benchmarks.peers_gpu import beam_runs, train_runs

    cpu = torch.device("cpu")
    runs = train_runs(None, (), TINY, cpu, precision, "default")
    assert set(runs) == {"ours", "ours_compiled"}
    for run in runs.values():
        run()
    searches = beam_runs(None, (), TINY, cpu, precision, "default", 3)
    assert set(searches) == {"ours", "ours_compiled"}
    for search in searches.values():
        search()
