"""Pretrained weights by name, from the libraries' own caches, with the network off.

Each test fills a cache with a file it writes, under the name the library looks for (torch.hub:
``$TORCH_HOME/hub/checkpoints/<file name of the URL>``; Hugging Face: ``models--timm--<name>/refs/main`` and
``snapshots/<commit>/model.safetensors``), and checks that exactly those tensors arrive. Nothing is mocked:
torchvision, timm and huggingface_hub run as they do for users. huggingface_hub reads ``HF_HOME`` and
``HF_HUB_OFFLINE`` once, when imported, so the timm loads run in a fresh interpreter with that environment.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from safetensors.torch import save_file
from timm.layers import resample_abs_pos_embed

from tests.conftest import REPO, run_in_process, tiny
from vision_attn.captioning.encoder import AnnotationEncoder, SmallCNN
from vision_attn.errors import CheckpointError
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.vision_transformer import VisionTransformer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
RESNET_TRUNK = {"0.0": "conv1", "0.1": "bn1", "1": "layer1", "2": "layer2", "3": "layer3", "4": "layer4"}
TINY_VIT = dict(embed_dim=192, depth=12, num_heads=3, patch_size=16)


# --- helpers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet50_state() -> dict[str, torch.Tensor]:
    """A freshly initialised torchvision ResNet-50 (its BatchNorm statistics made non-trivial)."""
    torch.manual_seed(0)
    state = torchvision.models.resnet50(weights=None).state_dict()
    return {k: torch.randn_like(v) if k.endswith("running_mean") else v for k, v in state.items()}


def torch_hub_checkpoint(torch_home: Path, weights: torchvision.models.WeightsEnum) -> Path:
    """Where torch.hub keeps ``weights``' file: $TORCH_HOME/hub/checkpoints/<the file name of its URL>."""
    return torch_home / "hub" / "checkpoints" / weights.url.rsplit("/", 1)[1]


def fill_hub_cache(hub: Path, repo_id: str, state: dict[str, torch.Tensor]) -> Path:
    """huggingface_hub's cache layout: ``models--<org>--<name>/refs/main`` holds the commit, and
    ``snapshots/<commit>/`` the files of that commit."""
    folder = hub / f"models--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snapshot / "model.safetensors"))
    return snapshot / "model.safetensors"


def fresh_environment(tmp_path: Path, *, offline: bool, **extra: str) -> dict[str, str]:
    """This environment with empty torch.hub and Hugging Face caches under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items()
           if k.upper() not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE", "NO_PROXY")}
    env.update(TORCH_HOME=str(tmp_path / "torch"), HF_HOME=str(tmp_path / "hf"),
               HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), PYTHONPATH=str(REPO), **extra)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_python(code: str, env: dict[str, str], *args: str) -> dict:
    """Run ``code`` with ``args`` in a fresh interpreter with ``env``; it prints one JSON object last."""
    result = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Runs in the fresh interpreter: each call's error (one line?) and how long it took.
TRY_ENCODERS = """
import json, sys, time
from vision_attn.captioning.encoder import AnnotationEncoder
outcomes = {}
for backbone in sys.argv[1:]:
    start = time.monotonic()
    try:
        AnnotationEncoder(backbone=backbone, pretrained="imagenet")
        outcomes[backbone] = {"error": None}
    except Exception as error:
        outcomes[backbone] = {"type": type(error).__name__, "error": str(error)}
    outcomes[backbone]["seconds"] = time.monotonic() - start
print(json.dumps(outcomes))
"""


def assert_one_line(message: str, *needles: str) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, message


# --- torchvision: $TORCH_HOME/hub/checkpoints --------------------------------------------------------


@pytest.mark.parametrize("name, member", [("imagenet", "DEFAULT"), ("IMAGENET1K_V1", "IMAGENET1K_V1"),
                                          ("ResNet50_Weights.IMAGENET1K_V2", "IMAGENET1K_V2")])
def test_torchvision_weights_by_name_load_from_the_torch_hub_cache_offline(name, member, resnet50_state, tmp_path,
                                                                          monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no download would be allowed: the file must come from the cache
    assert torch.hub.get_dir() == str(tmp_path / "hub")  # torch.hub reads TORCH_HOME at each call
    cached = torch_hub_checkpoint(tmp_path, torchvision.models.ResNet50_Weights[member])
    cached.parent.mkdir(parents=True)
    torch.save(resnet50_state, cached)

    encoder = AnnotationEncoder(backbone="resnet50", pretrained=name)

    trunk = encoder.trunk.state_dict()
    for key, value in trunk.items():
        stage, rest = (key[:3], key[4:]) if key.startswith("0.") else (key[:1], key[2:])
        assert torch.equal(value, resnet50_state[f"{RESNET_TRUNK[stage]}.{rest}"]), key
    assert len(trunk) == len([k for k in resnet50_state if not k.startswith("fc.")])
    assert encoder.pretrained_with == {"image": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}


def test_imagenet_means_torchvisions_default_weights() -> None:
    from vision_attn.weights import torch_hub_file

    assert torchvision.models.VGG19_Weights.DEFAULT.name == "IMAGENET1K_V1"  # as the docstrings say
    assert torchvision.models.ResNet101_Weights.DEFAULT.name == "IMAGENET1K_V2"
    assert torch_hub_file(torchvision.models.VGG19_Weights.DEFAULT.url).name == "vgg19-dcbb9e9d.pth"


def test_torchvision_weights_missing_offline_are_one_line_naming_the_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    weights = torchvision.models.ResNet50_Weights.DEFAULT
    start = time.monotonic()
    with pytest.raises(CheckpointError) as raised:
        AnnotationEncoder(backbone="resnet50", pretrained="imagenet")
    assert time.monotonic() - start < 5
    assert_one_line(str(raised.value), str(torch_hub_checkpoint(tmp_path, weights)), weights.url, "HF_HUB_OFFLINE")
    assert not torch_hub_checkpoint(tmp_path, weights).exists()


def test_the_cli_reports_missing_torchvision_weights_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_in_process("fit", *tiny("captioner_tiny.yaml"),
                            "--data.init_args.root", str(tmp_path / "scenes"), "--trainer.default_root_dir",
                            str(tmp_path / "run"), "--model.init_args.encoder.backbone", "resnet50",
                            "--model.init_args.encoder.pretrained", "imagenet")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert str(tmp_path / "torch" / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth") in errors[0]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_failing_download_is_one_line_and_fast(tmp_path) -> None:
    """Online, nothing cached, and the network refuses (a proxy on a closed port): no traceback, no retries."""
    proxy = f"http://127.0.0.1:{closed_port()}"
    env = fresh_environment(tmp_path, offline=False, HTTPS_PROXY=proxy, https_proxy=proxy, HTTP_PROXY=proxy,
                            http_proxy=proxy)
    outcomes = run_python(TRY_ENCODERS, env, "resnet50", "timm:resnet18")
    torchvision_outcome, timm_outcome = outcomes["resnet50"], outcomes["timm:resnet18"]
    assert torchvision_outcome["type"] == timm_outcome["type"] == "CheckpointError", outcomes
    assert_one_line(torchvision_outcome["error"], "downloading it failed",
                    str(tmp_path / "torch" / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth"),
                    "https://download.pytorch.org/models/resnet50-11ad3fa6.pth")
    assert_one_line(timm_outcome["error"], "cannot be reached",
                    str(tmp_path / "hf" / "hub" / "models--timm--resnet18.a1_in1k" / "snapshots"),
                    "https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors")
    assert torchvision_outcome["seconds"] < 5 and timm_outcome["seconds"] < 5, outcomes  # huggingface_hub's own
    # retries would take ~45 s


# --- timm: the Hugging Face hub cache ----------------------------------------------------------------------


def test_timm_weights_load_from_the_hugging_face_cache_offline(tmp_path) -> None:
    torch.manual_seed(0)
    written = timm.create_model("resnet18").state_dict()
    repo_id = timm.models.get_pretrained_cfg("resnet18").hf_hub_id  # what pretrained=True resolves to
    assert repo_id == "timm/resnet18.a1_in1k"
    fill_hub_cache(tmp_path / "hf" / "hub", repo_id, written)
    code = """
import json, sys, time, torch
from vision_attn.captioning.encoder import AnnotationEncoder
encoder = AnnotationEncoder(backbone="timm:resnet18", pretrained="imagenet")
torch.save(encoder.trunk.body.state_dict(), sys.argv[1])
start = time.monotonic()
try:
    AnnotationEncoder(backbone="timm:resnet18", pretrained="tv_in1k")
    missing = None
except Exception as error:
    missing = {"type": type(error).__name__, "error": str(error)}
print(json.dumps({"pretrained_with": encoder.pretrained_with, "missing": missing,
                  "seconds": time.monotonic() - start}))
"""
    outcome = run_python(code, fresh_environment(tmp_path, offline=True), str(tmp_path / "trunk.pt"))

    trunk = torch.load(tmp_path / "trunk.pt", weights_only=True)
    assert trunk and all(torch.equal(value, written[key]) for key, value in trunk.items())
    assert set(written) - set(trunk) == {"fc.weight", "fc.bias"}
    assert outcome["pretrained_with"] == {"image": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}
    # another tag of the same model is not cached: one line naming where it was looked for, at once
    assert outcome["missing"]["type"] == "CheckpointError"
    assert_one_line(outcome["missing"]["error"], "HF_HUB_OFFLINE",
                    str(tmp_path / "hf" / "hub" / "models--timm--resnet18.tv_in1k" / "snapshots"),
                    "https://huggingface.co/timm/resnet18.tv_in1k/resolve/main/model.safetensors")
    assert outcome["seconds"] < 5


def test_timm_vit_weights_load_by_name_and_adapt_to_another_image_size(tmp_path) -> None:
    torch.manual_seed(0)
    written = timm.create_model("vit_tiny_patch16_224").state_dict()
    fill_hub_cache(tmp_path / "hf" / "hub", "timm/vit_tiny_patch16_224.augreg_in21k_ft_in1k", written)
    code = f"""
import json, sys, torch
from vision_attn.vit.vision_transformer import VisionTransformer
from vision_attn.vit.pretrained import load_pretrained
same = VisionTransformer(img_size=224, in_chans=3, num_classes=10, **{TINY_VIT!r})
smaller = VisionTransformer(img_size=112, in_chans=3, num_classes=10, **{TINY_VIT!r})
fresh = [load_pretrained(same, "timm:vit_tiny_patch16_224"),
         load_pretrained(smaller, "timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k")]
torch.save({{"same": same.state_dict(), "smaller": smaller.state_dict()}}, sys.argv[1])
print(json.dumps({{"fresh": fresh}}))
"""
    outcome = run_python(code, fresh_environment(tmp_path, offline=True), str(tmp_path / "vits.pt"))

    loaded = torch.load(tmp_path / "vits.pt", weights_only=True)
    assert outcome["fresh"] == [["head.weight", "head.bias"]] * 2  # 1000 ImageNet classes -> a fresh 10-class head
    for model in ("same", "smaller"):
        for key in ("blocks.5.attn.qkv.weight", "blocks.11.mlp.fc2.bias", "patch_embed.proj.weight", "cls_token"):
            assert torch.equal(loaded[model][key], written[key]), (model, key)
    assert torch.equal(loaded["same"]["pos_embed"], written["pos_embed"])
    expected = resample_abs_pos_embed(written["pos_embed"], new_size=(7, 7), num_prefix_tokens=1)
    assert loaded["smaller"]["pos_embed"].shape == (1, 50, 192)
    assert torch.allclose(loaded["smaller"]["pos_embed"], expected, atol=1e-5)


def test_a_bare_timm_model_name_for_the_vit_says_how_to_name_timm_weights() -> None:
    model = VisionTransformer(img_size=32, in_chans=3, num_classes=10, embed_dim=16, depth=1, num_heads=2,
                              patch_size=8)
    with pytest.raises(CheckpointError, match="write timm:vit_tiny_patch16_224$"):
        load_pretrained(model, "vit_tiny_patch16_224")


# --- names that do not exist, and local files ----------------------------------------------------------------


def test_an_unknown_weights_name_is_one_line_listing_the_valid_ones() -> None:
    with pytest.raises(CheckpointError) as raised:
        AnnotationEncoder(backbone="resnet50", pretrained="IMAGENET1K_V3")
    assert_one_line(str(raised.value), "imagenet (= IMAGENET1K_V2)", "IMAGENET1K_V1, IMAGENET1K_V2")
    with pytest.raises(CheckpointError) as raised:
        AnnotationEncoder(backbone="timm:resnet18", pretrained="in22k")
    assert_one_line(str(raised.value), "'in22k'", "a1_in1k", "tv_in1k", "timm's default, a1_in1k")


def test_the_small_cnn_has_no_named_weights() -> None:
    with pytest.raises(CheckpointError) as raised:
        AnnotationEncoder(backbone="small", pretrained="imagenet")
    assert_one_line(str(raised.value), "small backbone has no named weights")


def test_an_existing_file_wins_over_a_name_and_a_missing_file_keeps_its_error(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    source = SmallCNN(8)
    torch.save(source.state_dict(), tmp_path / "imagenet")
    encoder = AnnotationEncoder(backbone="small", width=8, pretrained="imagenet")
    assert torch.equal(encoder.trunk[0][0].weight, source[0][0].weight)
    with pytest.raises(CheckpointError, match=r"resnet50.pth: no such file \(a checkpoint file was expected\)"):
        AnnotationEncoder(backbone="resnet50", pretrained="resnet50.pth")


def test_a_local_timm_file_loads_as_timm_loads_it_into_features_only(tmp_path) -> None:
    """ConvNeXt's feature wrapper renames its stages (stages.0 -> stages_0): a timm weights file still fits."""
    torch.manual_seed(0)
    torch.save(timm.create_model("convnext_atto").state_dict(), tmp_path / "convnext_atto.pth")
    encoder = AnnotationEncoder(backbone="timm:convnext_atto", pretrained=tmp_path / "convnext_atto.pth")
    theirs = timm.create_model("convnext_atto", pretrained=True, features_only=True, out_indices=(-1,),
                               pretrained_cfg_overlay=dict(file=str(tmp_path / "convnext_atto.pth")))
    ours = encoder.trunk.body.state_dict()
    assert list(ours) == list(theirs.state_dict())
    assert all(torch.equal(ours[key], value) for key, value in theirs.state_dict().items())
