"""The feature cache of a frozen encoder: what it stores is what the encoder computes, a killed fill resumes
without redoing or reading half-written shards, ranks split the work, a changed setting or image is never read
from a stale cache, and fit/test/cache-features use it through the CLI."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import printed_metrics, run_in_process, run_script, tiny
from vision_attn.data.coco import load_caption_image
from vision_attn.data.feature_cache import FeatureCache
from vision_attn.datamodules import CocoCaptionsDataModule
from vision_attn.tasks import CaptionerTask


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cache_scenes") / "scenes"
    CocoCaptionsDataModule(str(root), scenes={"generate": True, "counts": {"train": 24, "val": 6, "test": 6}})
    return root


def data_and_model(scenes: Path, cache: Path, trainable_stages: int, **data) -> tuple:
    datamodule = CocoCaptionsDataModule(str(scenes), loader={"batch_size": 8, "eval_batch_size": 5},
                                        feature_cache={"folder": str(cache)}, **data)
    datamodule.setup("fit")
    torch.manual_seed(0)
    module = CaptionerTask(vocabulary=datamodule.vocab_tokens, image=datamodule.image_format,
                           encoder={"width": 8, "trainable_stages": trainable_stages},
                           decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16})
    return datamodule, module


@pytest.mark.parametrize("trainable_stages", [0, 1], ids=["all_frozen", "last_stage_trains"])
def test_cached_features_are_what_the_frozen_encoder_computes(scenes, tmp_path, trainable_stages) -> None:
    datamodule, module = data_and_model(scenes, tmp_path / "cache", trainable_stages)
    encoder = module.model.encoder.eval()
    part = module.frozen_encoder_part()
    caches = datamodule.feature_caches(part, ["train"])
    datamodule.fill_feature_caches(part, caches, progress=False)
    cache = caches["train"]
    records = datamodule.records("train")
    images = datamodule.normalize(torch.stack([load_caption_image(r.path, 96) for r in records]))
    with torch.no_grad():
        expected = encoder.frozen_part()(images)  # (B, C, H, W): what the cache must hold, up to fp16 rounding
        direct, grid = encoder(images)  # the whole encoder on the pixels
        cached = torch.stack([cache[i] for i in range(len(records))])
        assert cached.dtype == torch.float16 and cached.shape == expected.shape
        torch.testing.assert_close(cached.float(), expected, atol=2e-3, rtol=2e-3)
        from_cache, cached_grid = encoder.from_frozen(cached)  # the rest of the encoder on the cache
    assert cached_grid == grid == (6, 6)
    torch.testing.assert_close(from_cache, direct, atol=1e-2, rtol=1e-2)
    # the training set now serves the cached features in place of the images
    datamodule.use_feature_cache("train", cache)
    item = datamodule.train_set[3]
    image_index = int(datamodule.train_set.image_index[3])
    assert item.image.dtype == torch.float16 and torch.equal(item.image, cache[image_index])


def test_a_killed_fill_resumes_without_redoing_shards_or_reading_half_written_ones(tmp_path) -> None:
    cache = FeatureCache(tmp_path, {"what": "test"}, count=22, shape=(2, 3), shard_size=4)  # 6 shards, last of 2
    encoded: list[int] = []

    def encode(batch: torch.Tensor) -> torch.Tensor:
        encoded.extend(int(row[0, 0]) for row in batch)
        return batch

    def load(index: int) -> torch.Tensor | None:
        return None if index == 13 else torch.full((2, 3), float(index))  # image 13 is unreadable

    assert cache.fill(load, encode, batch_size=3) == 22
    assert sorted(encoded) == [i for i in range(22) if i != 13] and cache.complete
    assert cache[13] is None and torch.equal(cache[21], torch.full((2, 3), 21.0, dtype=torch.float16))
    times = {path.name: path.stat().st_mtime_ns for path in cache.folder.glob("shard_*")}
    # a run killed mid-fill: shard 3 never renamed into place, shard 5 cut short, a temporary file left behind
    (cache.folder / "shard_00003.npy").unlink()
    (cache.folder / ".shard_00003.npy.999.tmp").write_bytes(b"\x93NUMPY half a shard")
    with open(cache.folder / "shard_00005.npy", "r+b") as handle:
        handle.truncate(60)
    assert cache.missing() == [3, 5]
    encoded.clear()
    assert cache.fill(load, encode, batch_size=3) == 4 + 2
    assert sorted(encoded) == [12, 14, 15, 20, 21]  # only the missing shards' images (13 is unreadable)
    for path in cache.folder.glob("shard_*"):
        if path.name.split(".")[0] not in ("shard_00003", "shard_00005"):
            assert path.stat().st_mtime_ns == times[path.name], path.name  # finished shards are not rewritten
    assert cache.complete and torch.equal(cache[14], torch.full((2, 3), 14.0, dtype=torch.float16))


def test_ranks_fill_disjoint_shards_and_together_complete_the_cache(tmp_path) -> None:
    def cache() -> FeatureCache:
        return FeatureCache(tmp_path, {"what": "ddp"}, count=10, shape=(1,), shard_size=3)  # 4 shards

    written: dict[int, list[int]] = {0: [], 1: []}
    for rank in (0, 1):
        def encode(batch: torch.Tensor, rank: int = rank) -> torch.Tensor:
            written[rank].extend(int(v) for v in batch[:, 0])
            return batch

        cache().fill(lambda i: torch.tensor([float(i)]), encode, batch_size=2, rank=rank, world_size=2)
    assert written == {0: [0, 1, 2, 6, 7, 8], 1: [3, 4, 5, 9]}  # shards 0, 2 and 1, 3: nothing twice
    assert cache().complete and [float(cache()[i]) for i in range(10)] == [float(i) for i in range(10)]


def test_a_changed_setting_or_image_never_reads_the_old_cache(scenes, tmp_path) -> None:
    datamodule, module = data_and_model(scenes, tmp_path, 0)

    def caches(datamodule: CocoCaptionsDataModule = datamodule) -> FeatureCache:
        return datamodule.feature_caches(module.frozen_encoder_part(), ["val"])["val"]

    first = caches()
    other_size, _ = data_and_model(scenes, tmp_path, 0, image_size=64)
    other_std, _ = data_and_model(scenes, tmp_path, 0, std=[0.5, 0.5, 0.5])
    assert caches(other_size).folder != first.folder
    assert caches(other_std).folder != first.folder
    with torch.no_grad():
        module.model.encoder.trunk[0][0].weight[0, 0, 0, 0] += 1e-3  # other weights
    assert caches().folder != first.folder
    with torch.no_grad():
        module.model.encoder.trunk[0][0].weight[0, 0, 0, 0] -= 1e-3
    assert caches().folder == first.folder
    image = datamodule.records("val")[0].path
    stat = image.stat()
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # an image rewritten since
    try:
        assert caches().folder != first.folder
    finally:
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # a folder whose key.json disagrees with its name (edited, or another format) is stale: its shards count as
    # missing before the fill empties the folder, so what is counted to fill is what is filled
    first.fill(lambda i: torch.zeros(first.shape), lambda batch: batch, batch_size=8)
    (first.folder / "key.json").write_text('{"format": 0}')
    assert first.missing() == list(range(first.num_shards))
    first.prepare()
    assert first.missing() == list(range(first.num_shards)) and not list(first.folder.glob("shard_*"))


def test_fit_and_test_read_the_cache_through_the_cli(scenes, tmp_path) -> None:
    cache, run = tmp_path / "cache", tmp_path / "run"
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(scenes),
              "--model.init_args.encoder.trainable_stages", "0", "--data.init_args.feature_cache.folder", str(cache)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ahead = run_in_process("cache-features", *common)
    assert ahead.returncode == 0, ahead.stderr[-3000:]
    # its arguments reach LightningCLI as a command line: no warning of args given beside sys.argv's own (the
    # deprecations are jsonargparse's, of Lightning's calls)
    assert not [w for w in caught if Path(w.filename).match("lightning/pytorch/cli.py")
                and not issubclass(w.category, DeprecationWarning)]
    assert "36 images x" in ahead.stdout and "(3 of 3 shards to fill)" in ahead.stdout
    folders = sorted(cache.iterdir())
    assert len(folders) == 3
    times = {p: p.stat().st_mtime_ns for p in cache.rglob("shard_*")}
    fitted = run_in_process("fit", *common, "--trainer.default_root_dir", str(run))
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("shard_*")} == times  # fit read it, wrote nothing
    checkpoint = next(run.rglob("last.ckpt"))
    tested = run_in_process("test", *common, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir",
                            str(tmp_path / "test"))
    assert tested.returncode == 0, tested.stderr[-3000:]
    assert "test/CIDEr-D" in tested.stdout
    again = run_in_process("cache-features", *common)
    assert "(0 of 3 shards to fill)" in again.stdout


def test_a_feature_cache_needs_a_frozen_encoder(tmp_path) -> None:
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"), "--data.init_args.root",
                            str(tmp_path / "s"), "--data.init_args.feature_cache.folder", str(tmp_path / "cache"),
                            "--trainer.default_root_dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: feature_cache needs a frozen encoder, whose output never changes: set the model's "
        "encoder.trainable_stages to 0 (all frozen) or to fewer stages than the trunk has")
    assert not (tmp_path / "cache").exists()


def test_features_beyond_fp16s_range_are_refused_before_a_shard_is_written(tmp_path) -> None:
    cache = FeatureCache(tmp_path, {"what": "overflow"}, count=4, shape=(2,), shard_size=2)
    with pytest.raises(ValueError, match=r"reaches 1.05e\+05 on image 2.., beyond fp16's range \(±65504\)"):
        cache.fill(lambda i: torch.tensor([float(i), 0.0]),
                   lambda batch: batch * (1.0 if batch[0, 0] < 2 else 35000.0), batch_size=2)
    assert cache.missing() == [1]  # the first shard is whole; nothing of the second was written
    assert not list(cache.folder.glob("shard_00001*")) and not list(cache.folder.glob(".*.tmp"))


@pytest.mark.heavy
def test_two_ddp_processes_fill_disjoint_shards_and_score_exactly_like_one(scenes, tmp_path) -> None:
    """`test` under DDP through the console script: the ranks fill disjoint shards of the cache, and score every
    test image once, as one process scores them from the cache they filled (metrics as printed, and the results
    file)."""
    checkpoint_run = tmp_path / "run"
    common = [*tiny("captioner_tiny.yaml"), "--data.init_args.root", str(scenes),
              "--model.init_args.encoder.trainable_stages", "0",
              "--data.init_args.feature_cache.folder", str(tmp_path / "cache"),
              "--data.init_args.feature_cache.shard_size", "2", "--data.init_args.loader.eval_batch_size", "1"]
    fitted = run_in_process("fit", *common, "--trainer.default_root_dir", str(checkpoint_run),
                            "--trainer.limit_val_batches", "0")
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    checkpoint = next(checkpoint_run.rglob("last.ckpt"))
    two = run_script("test", *common, "--ckpt_path", str(checkpoint), "--trainer.strategy", "ddp",
                     "--trainer.devices", "2", "--trainer.default_root_dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    # 6 test images in shards of 2: rank 0 fills shards 0 and 2, rank 1 shard 1; none is written twice
    assert "rank 0 of 2 filled 2 shards (4 images) of the test feature cache" in two.stderr
    assert "rank 1 of 2 filled 1 shards (2 images) of the test feature cache" in two.stderr
    one = run_in_process("test", *common, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir",
                         str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "filled" not in one.stderr  # the cache the two ranks filled is whole: read, not refilled
    one_metrics, two_metrics = printed_metrics(one.stdout), printed_metrics(two.stdout)
    assert set(one_metrics) == set(two_metrics)
    scored = ["test/BLEU-1", "test/BLEU-2", "test/BLEU-3", "test/BLEU-4", "test/METEOR", "test/ROUGE-L",
              "test/CIDEr-D", "test/pointing_words", "test/images"]
    assert {k: one_metrics[k] for k in scored} == {k: two_metrics[k] for k in scored}  # exactly, as printed
    assert one_metrics["test/images"] == "6.0"  # every test image once: none duplicated, none missing
    for averaged in ("test/loss", "test/ds_penalty"):  # means of per-rank means: float order differs
        assert float(one_metrics[averaged]) == pytest.approx(float(two_metrics[averaged]), rel=1e-5)
    results = [json.loads((tmp_path / run / "results_test.json").read_text()) for run in ("one", "two")]
    assert results[0] == results[1] and len(results[0]) == 6


@pytest.mark.parametrize("bad", ["a_file", "under_a_file", "shard_size_0"])
def test_a_bad_cache_folder_or_shard_size_is_one_line_before_any_work(scenes, tmp_path, bad) -> None:
    (tmp_path / "a_file").write_text("x")
    folder = {"a_file": tmp_path / "a_file", "under_a_file": tmp_path / "a_file" / "cache",
              "shard_size_0": tmp_path / "cache"}[bad]
    result = run_in_process("cache-features", *tiny("captioner_tiny.yaml"),
                            "--data.init_args.root", str(scenes), "--model.init_args.encoder.trainable_stages", "0",
                            "--data.init_args.feature_cache.folder", str(folder),
                            "--data.init_args.feature_cache.shard_size", "0" if bad == "shard_size_0" else "4")
    assert result.returncode == 2
    expected = {"a_file": f"error: {folder}: is a file, not a folder to write into",
                "under_a_file": f"error: {folder}: cannot be written, {tmp_path / 'a_file'} is a file, not a folder",
                "shard_size_0": "error: feature_cache.shard_size must be at least 1, got 0"}[bad]
    assert result.stderr.strip().splitlines()[-1] == expected
    assert (tmp_path / "a_file").read_text() == "x" and not (tmp_path / "cache").exists()


def test_cache_features_help_names_the_tool() -> None:
    helped = run_in_process("cache-features", "--help")
    assert helped.returncode == 0, helped.stderr[-3000:]
    assert helped.stdout.startswith("usage: vision-attn cache-features [-c CONFIG]")
