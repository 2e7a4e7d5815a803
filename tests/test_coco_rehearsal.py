"""A COCO rehearsal: the real COCO configs, end to end (each command through the console script's entry point, in
this process: a new one would import Lightning and start METEOR's Java again), on a small Karpathy-format
COCO of real-size JPEGs (landscape and portrait, EXIF-rotated, greyscale), with train/restval/val/test splits.
Only the accelerator, precision, sizes, limits and paths are overridden; the configs' ImageNet weights come
from a torch.hub cache the test fills (offline). The path is the README's: fit (filling
the feature cache), test, the results JSON scored by pycocoevalcap (`evaluate`), then `caption` and `overlay` on
the checkpoint (these three for coco_vgg19.yaml; coco_resnet101.yaml fits and tests, in bf16-mixed on a CPU that
computes bf16 natively, else in fp32). Images stay at the configs' 224 px, so each step runs at the real size."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import run_in_process, shipped
from vision_attn.hardware import cpu_flags, has_native_bf16
from vision_attn.metrics import java_available

# Small, as the frozen trunks run at the real 224 px. ResNet-101 gets two images a split: its trunk is the dearer,
# and on a CPU without native bf16 it runs in fp32; each of its paths still runs (a step, validation, the test)
SPLITS = {"coco_vgg19": {"train": 4, "restval": 2, "val": 4, "test": 4},
          "coco_resnet101": {"train": 2, "restval": 2, "val": 2, "test": 2}}


def ids_of_the_test_split(splits: dict[str, int]) -> list[int]:
    """The cocoids of the test split: the images are numbered in the splits' order."""
    return list(range(sum(splits.values()) - splits["test"] + 1, sum(splits.values()) + 1))


COLOURS = {"red": (200, 40, 40), "blue": (40, 60, 200), "green": (40, 160, 60), "yellow": (220, 200, 40)}
THINGS = ["bus", "cat", "dog", "kite"]


def photo(rng: random.Random, size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    """A photo-sized image: textured background, one coloured block (the thing its captions name)."""
    noise = torch.randint(60, 200, (size[1] // 16, size[0] // 16, 3), generator=torch.Generator().manual_seed(
        rng.randrange(10**6)), dtype=torch.uint8)
    image = Image.fromarray(noise.numpy()).resize(size, Image.Resampling.BILINEAR)
    left, top = rng.randrange(size[0] // 2), rng.randrange(size[1] // 2)
    image.paste(colour, (left, top, left + size[0] // 3, top + size[1] // 3))
    return image


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """A Karpathy-format COCO for a config, made the first time it is asked for."""
    made: dict[str, Path] = {}

    def for_config(config: str) -> Path:
        if config not in made:
            made[config] = write_coco(tmp_path_factory.mktemp(f"coco_{config}"), SPLITS[config])
        return made[config]

    return for_config


def write_coco(root: Path, splits: dict[str, int]) -> Path:
    """Photo-sized JPEGs of each split, five captions each, the Karpathy JSON and the test split's COCO captions."""
    rng = random.Random(0)
    entries, ground_truth = [], {"images": [], "annotations": [], "info": {}, "licenses": [], "type": "captions"}
    index = 0
    for split, count in splits.items():
        folder = "train2014" if split in ("train", "restval") else "val2014"
        (root / folder).mkdir(exist_ok=True)
        for _ in range(count):
            index += 1
            colour, thing = rng.choice(list(COLOURS)), rng.choice(THINGS)
            size = (640, 480) if index % 2 else (480, 640)
            image = photo(rng, size, COLOURS[colour])
            name = f"COCO_{folder}_{index:012d}.jpg"
            if index % 5 == 0:  # greyscale
                image.convert("L").save(root / folder / name, quality=90)
            elif index % 5 == 1:  # stored sideways, upright by its EXIF orientation (6: rotate 90° clockwise)
                exif = Image.Exif()
                exif[0x0112] = 6
                image.transpose(Image.Transpose.ROTATE_90).save(root / folder / name, quality=90, exif=exif)
            else:
                image.save(root / folder / name, quality=90)
            sentences = [f"a {colour} {thing} in the picture", f"there is a {colour} {thing}",
                         f"a photo of a {colour} {thing}", f"the {thing} is {colour}", f"a {thing} that is {colour}"]
            entries.append({"filepath": folder, "filename": name, "split": split, "cocoid": index, "imgid": index,
                            "sentences": [{"raw": s, "tokens": s.split()} for s in sentences]})
            if split == "test":
                ground_truth["images"].append({"id": index, "file_name": name, "width": size[0], "height": size[1]})
                ground_truth["annotations"] += [{"id": index * 10 + n, "image_id": index, "caption": s}
                                                for n, s in enumerate(sentences)]
    (root / "dataset_coco.json").write_text(json.dumps({"images": entries, "dataset": "coco"}))
    (root / "captions_test.json").write_text(json.dumps(ground_truth))
    return root


def fill_torch_hub_cache(torch_home: Path, backbone: str) -> dict[str, torch.Tensor]:
    """Put freshly initialised weights of ``backbone``'s trunk where torch.hub keeps torchvision's ImageNet file
    for ``pretrained_encoder: imagenet`` (no network here); returns them."""
    import torchvision

    weights = torchvision.models.get_model_weights(backbone).DEFAULT
    # zero_init_residual: each ResNet block starts as the identity, as trained ones nearly are; left random, the
    # 30 blocks up to layer3 grow its output beyond fp16's range, which the cache refuses
    options = {"zero_init_residual": True} if backbone.startswith("resnet") else {}
    model = getattr(torchvision.models, backbone)(weights=None, **options)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("classifier.", "fc."))}  # trunk only
    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / Path(weights.url).name)
    return state


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX), as its flags say, less the kernels torch and
    oneDNN were told not to use (``hardware.cpu_flags``)."""
    return has_native_bf16(cpu_flags())


# VISION_ATTN_TEST_DEVICE=cuda (scripts/gpu_check.sh) runs both configs on the GPU in both mixed precisions
ON_GPU = os.environ.get("VISION_ATTN_TEST_DEVICE", "cpu") == "cuda"
CASES = [(config, precision) for config in ("coco_vgg19", "coco_resnet101")
         for precision in ("bf16-mixed", "16-mixed")] if ON_GPU else [("coco_vgg19", "32-true"),
                                                                      ("coco_resnet101", "bf16-mixed")]


@pytest.mark.heavy
@pytest.mark.parametrize("config, precision", CASES)
def test_the_coco_configs_fit_test_score_caption_and_overlay(coco, tmp_path, monkeypatch, config,
                                                            precision) -> None:
    if precision == "bf16-mixed" and not native_bf16() and not ON_GPU:
        # Without avx512_bf16 the CPU emulates bf16: ResNet-101 at 224 px runs 6.4x slower than in fp32 (5.6 s
        # against 36 s for 4 images on the 2-core model-1 EPYC), which would cost the suite ~100 s. bf16-mixed
        # training, testing and captioning stay covered by tests/test_mixed_precision.py on every machine.
        precision = "32-true"
    run, cache, splits, coco = tmp_path / "run", tmp_path / "cache", SPLITS[config], coco(config)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # the configs' `pretrained_encoder: imagenet`
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # ... comes from that cache, never from the network
    imagenet = fill_torch_hub_cache(tmp_path / "torch_home", config.removeprefix("coco_"))
    common = [
        *shipped("trainer/gpu.yaml", "tasks/captioner.yaml", "data/coco.yaml", f"captioner/{config}.yaml"),
        "--trainer.accelerator", "gpu" if ON_GPU else "cpu", "--trainer.precision", precision,
        "--data.init_args.root", str(coco), "--data.init_args.loader.num_workers", "0",
        "--data.init_args.loader.batch_size", "4", "--data.init_args.loader.eval_batch_size", "4",
        "--data.init_args.feature_cache.folder", str(cache),
    ]
    fit = run_in_process("fit", *common, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                         "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(run),
                         "--trainer.logger.init_args.save_dir", str(run))
    assert fit.returncode == 0, fit.stderr[-3000:]
    keys = [json.loads(key.read_text()) for key in cache.glob("*/key.json")]
    assert sorted(key["count"] for key in keys) == [splits["val"], splits["train"] + splits["restval"]]  # by fit
    key = max(keys, key=lambda key: key["count"])  # train, restval joined to it
    assert key["image_size"] == 224
    shape = (512, 14, 14) if config == "coco_vgg19" else (1024, 14, 14)  # conv5_4, or resnet's layer3 (layer4 trains)
    assert tuple(key["shape"]) == shape

    checkpoint = next(run.rglob("best.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]  # saved on the GPU, maybe
    trunk = {k: v for k, v in state.items() if ".trunk." in k}
    conv = "features.0.weight" if config == "coco_vgg19" else "conv1.weight"
    assert torch.equal(next(v for k, v in trunk.items() if k.endswith("trunk.0.weight") or
                            k.endswith("trunk.0.0.weight")), imagenet[conv])  # the cached weights, frozen
    tested = run_in_process("test", *common, "--ckpt_path", str(checkpoint), "--trainer.default_root_dir",
                        str(tmp_path / "test"), "--trainer.logger", "false")
    assert tested.returncode == 0, tested.stderr[-3000:]
    results = next((tmp_path / "test").rglob("results_test.json"))
    records = json.loads(results.read_text())
    assert sorted(r["image_id"] for r in records) == ids_of_the_test_split(splits)  # the test images, by cocoid
    assert all(r["grid"] == [14, 14] for r in records) and all(len(row) == 196 for r in records for row in r["alphas"])
    if config != "coco_vgg19":
        return  # the rest reads only the checkpoint: once, with the paper's config, keeps the suite short
    scores = tmp_path / "scores.json"
    evaluated = run_in_process("evaluate", str(results), "--annotations", str(coco / "captions_test.json"),
                           "--out", str(scores))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    scored = {"BLEU-4", "ROUGE-L", "CIDEr-D"} | ({"METEOR"} if java_available() else set())  # METEOR runs on Java
    assert scored <= set(json.loads(scores.read_text()))

    images = sorted((coco / "val2014").glob("*.jpg"))[-3:]  # among them one EXIF-rotated and one greyscale
    out = tmp_path / "captions.json"
    on_device = ["--device", "cuda"] if ON_GPU else []
    captioned = run_in_process("caption", "--ckpt", str(checkpoint), *map(str, images), "--out", str(out), *on_device)
    assert captioned.returncode == 0, captioned.stderr[-3000:]
    assert len(json.loads(out.read_text())) == 3
    overlaid = run_in_process("overlay", "--ckpt", str(checkpoint), *map(str, images), "--out", str(tmp_path / "ov"),
                          *on_device)
    assert overlaid.returncode == 0, overlaid.stderr[-3000:]
    assert len(list((tmp_path / "ov").glob("*.png"))) == 3
