"""The annotation-vector encoder of "Show, Attend and Tell" (Xu et al. 2015, §3.1.1).

A trunk turns an image into a grid of features; each of the L = Gh·Gw cells is an annotation vector a_i ∈ R^D.
The paper's is VGG-19's conv5_4 (14×14×512 at 224 px); also here: ResNet-50/101 (layer4, optionally pooled), any
timm backbone (``features_only``), a small CNN that learns on a CPU in minutes, and this project's ViT, whose patch
tokens are the annotation vectors (``vit_trunk.py``). Pretrained weights are a local file, or a name that
torchvision or timm resolve in their caches (``vision_attn.weights``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from vision_attn.captioning.options import EncoderOptions
from vision_attn.captioning.vit_trunk import vit_trunk
from vision_attn.checkpoint import extract_state_dict, hyper_parameters, load_file
from vision_attn.data.feature_cache import FrozenPart
from vision_attn.errors import CheckpointError
from vision_attn.weights import (
    TORCHVISION_BACKBONES,
    create_timm_model,
    is_weights_name,
    no_named_weights,
    timm_pretrained_name,
    torchvision_weights,
)

log = logging.getLogger(__name__)


class SmallCNN(nn.Sequential):
    """A CPU-sized trunk: S×S×3 -> S/stride × S/stride × 8·width, one conv-BN-ReLU per stage; strides 2, 2, then
    2×2 max-pools twice (stride 16: the receptive field covers one Fashion-MNIST item) or once (stride 8)."""

    def __init__(self, width: int = 32, in_chans: int = 3, *, stride: int = 16) -> None:
        if stride not in (8, 16):
            raise ValueError(f"the small CNN's output stride is 8 or 16, got {stride}")

        def stage(inputs: int, outputs: int, *, stride: int = 1, pool: bool = False) -> nn.Sequential:
            layers = [nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(outputs),
                      nn.ReLU(inplace=True)]
            return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)

        super().__init__(stage(in_chans, width, stride=2), stage(width, 2 * width, stride=2),
                         stage(2 * width, 4 * width, pool=True), stage(4 * width, 8 * width, pool=stride == 16))
        self.out_channels = 8 * width


# torchvision and timm are imported by the backbones that need them: importing torchvision is slow, and the small
# CNN (and so captioning a photo with the default model) does not pay for it.
def _vgg19_conv5_4() -> tuple[nn.Sequential, int]:
    import torchvision

    with torch.device("meta"):  # VGG's classifier (fc6-fc8) is never used: it is not allocated nor initialised
        vgg = torchvision.models.vgg19(weights=None)
    features = vgg.features[:36].to_empty(device="cpu")  # up to the ReLU after conv5_4, before the last max-pool
    for layer in features:
        if isinstance(layer, nn.Conv2d):  # torchvision's VGG initialisation
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(layer.bias)
    return features, 512


def _resnet_layer4(depth: int) -> tuple[nn.Sequential, int]:
    import torchvision

    resnet = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool)
    return nn.Sequential(stem, resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4), 2048


class _TimmFeatures(nn.Module):
    # the last feature map of a timm backbone built with ``features_only``; ``weights``: ``<architecture>.<tag>``

    def __init__(self, name: str, *, weights: str | None = None) -> None:
        super().__init__()
        import timm

        if weights:
            self.body = create_timm_model(weights, features_only=True, out_indices=(-1,))
        else:
            try:
                self.body = timm.create_model(name, pretrained=False, features_only=True, out_indices=(-1,))
            except RuntimeError as error:
                raise ValueError(f"timm backbone '{name}': {error}") from None
        self.out_channels = self.body.feature_info.channels()[-1]

    def forward(self, images: Tensor) -> Tensor:
        return self.body(images)[-1]


def _timm_trunk_names(state: dict[str, Tensor], own: dict[str, Tensor]) -> dict[str, Tensor]:
    # a timm model's (or our trunk's) state under our ``features_only`` trunk's names: FeatureListNet flattens
    # ``stages.0`` to ``stages_0``, FeatureGetterNet nests the model under ``model.``; an unmatched key is kept
    def plain(key: str) -> str:
        return key.removeprefix("body.").replace(".", "_")

    trunk_names = {plain(k.removeprefix("body.model.")): k for k in own} | {plain(k): k for k in own}
    return {trunk_names.get(plain(k), k if k.startswith("body.") else f"body.{k}"): v for k, v in state.items()}


class AnnotationEncoder(nn.Module):
    """Image (B, 3, H, W) -> annotation vectors (B, L, D) over a Gh×Gw grid, as ``options`` (``EncoderOptions``, or
    its fields as keywords) say, for square inputs of ``image_size`` pixels.

    ``options.pretrained`` is a local file or a weights name: ``imagenet`` (torchvision's DEFAULT; for timm, what
    ``pretrained=True`` loads), a torchvision enum member (``IMAGENET1K_V1``) or a timm tag (``a1_in1k``). Backbone
    ``vit`` needs a `vision-attn fit` ViT checkpoint or timm-format ViT weights; ``self.options`` then records the
    ViT's architecture (``vit``), so a captioner checkpoint rebuilds it without the file.
    """

    def __init__(self, options: EncoderOptions | None = None, *, image_size: int = 224, **fields: Any) -> None:
        super().__init__()
        options = EncoderOptions.merged(options, **fields)
        backbone, pretrained = options.backbone, options.pretrained
        self.backbone_name = backbone
        named = is_weights_name(pretrained) and backbone != "vit"
        self.pretrained_with: dict = {}
        if backbone == "small":
            self.trunk: nn.Module = SmallCNN(options.width, stride=options.stride)
            self.annotation_dim = self.trunk.out_channels
        elif backbone == "vgg19":
            self.trunk, self.annotation_dim = _vgg19_conv5_4()
        elif backbone in ("resnet50", "resnet101"):
            self.trunk, self.annotation_dim = _resnet_layer4(int(backbone.removeprefix("resnet")))
        elif backbone.startswith("timm:"):
            model_name = backbone.removeprefix("timm:")
            weights = timm_pretrained_name(model_name, str(pretrained)) if named else None
            self.trunk = _TimmFeatures(model_name, weights=weights)
            self.annotation_dim = self.trunk.out_channels
        else:  # vit
            self.trunk, vit_options, vit_hparams = vit_trunk(pretrained, image_size, options.vit)
            self.annotation_dim = self.trunk.out_channels
            if pretrained:
                log.info("ViT encoder from %s: a %dx%d grid of %d-dim patch tokens (the ViT was trained at %s px)",
                         pretrained, *self.trunk[-1].grid, self.annotation_dim,
                         (vit_hparams.get("image") or {}).get("size", "?"))
            options = replace(options, vit=vit_options)
            pretrained = None  # loaded
        self.options = options
        self.pool = nn.AdaptiveAvgPool2d(options.grid_size) if options.grid_size else nn.Identity()
        if named:
            self.use_named_weights(str(pretrained))
        elif pretrained:
            self.load_trunk_weights(pretrained)
        self.set_trainable_stages(options.trainable_stages)
        # NHWC convolutions: oneDNN's fast path on CPUs (docs/benchmarks.md), and tensor cores' under mixed
        # precision on GPUs. Loading weights keeps this layout (copy_ keeps strides).
        self.channels_last = options.channels_last
        if options.channels_last:
            self.trunk.to(memory_format=torch.channels_last)

    def load_trunk_weights(self, path: str | os.PathLike) -> None:
        """Load a torchvision/timm/own trunk's state dict, or the trunk of a ``vision-attn fit`` encoder pretraining or
        captioner checkpoint, from a local file, keeping its hyper-parameters as ``pretrained_with``."""
        loaded = load_file(path)
        state = extract_state_dict(loaded)
        for prefix in ("encoder.trunk.", "model.encoder.trunk."):  # a vision-attn encoder pretraining or captioner
            if any(k.startswith(prefix) for k in state):  # (a captioner's keys keep ``model.``: not all have it)
                state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
                break
        self.pretrained_with = hyper_parameters(loaded)
        self._load_trunk_state(state, path)

    def use_named_weights(self, name: str) -> None:
        """Load the weights ``name`` through torchvision's cache (a timm trunk loaded them when built); their
        normalisation becomes ``pretrained_with``."""
        if self.backbone_name in TORCHVISION_BACKBONES:
            weights = torchvision_weights(self.backbone_name, name)
            self._load_trunk_state(weights.state_dict, weights.source)
            mean, std = weights.mean, weights.std
        elif isinstance(self.trunk, _TimmFeatures):
            config = self.trunk.body.pretrained_cfg
            mean, std = list(config["mean"]), list(config["std"])
        else:
            raise no_named_weights(self.backbone_name, name)
        self.pretrained_with = {"image": {"mean": mean, "std": std}}

    def _load_trunk_state(self, state: dict[str, Tensor], source: str | os.PathLike) -> None:
        own = self.trunk.state_dict()
        if self.backbone_name.startswith("timm:"):
            state = _timm_trunk_names(state, own)
        file_key = {k: k for k in state}  # the trunk's name -> the file's (named in errors)
        if self.backbone_name == "vgg19":  # torchvision names: features.N.*
            file_key = {k.removeprefix("features."): k for k in state}
        elif self.backbone_name.startswith("resnet"):  # torchvision names: conv1, bn1, layer1..4, fc
            renamed = {"conv1": "0.0", "bn1": "0.1", "layer1": "1", "layer2": "2", "layer3": "3", "layer4": "4"}
            file_key = {renamed[k.split(".", 1)[0]] + "." + k.split(".", 1)[1]: k
                        for k in state if k.split(".", 1)[0] in renamed}
        usable = {k: state[name] for k, name in file_key.items() if k in own}
        another = f"weights for another architecture than the {self.backbone_name} trunk"
        if not usable:
            raise CheckpointError(f"{source}: {another}, none of its keys matches the trunk's")
        wrong = [k for k, v in usable.items() if v.shape != own[k].shape]
        if wrong:
            raise CheckpointError(f"{source}: {another}, {file_key[wrong[0]]} is {tuple(usable[wrong[0]].shape)} in "
                                  f"the file but {tuple(own[wrong[0]].shape)} in the trunk")
        missing = [k for k in own if k not in usable and not k.endswith("num_batches_tracked")]
        if missing:
            raise CheckpointError(f"{source}: {another}, {len(missing)} of the trunk's weights are not in the file, "
                                  f"e.g. {missing[0]}")
        self.trunk.load_state_dict(usable, strict=False)
        log.info("loaded %d trunk tensors from %s", len(usable), source)

    def set_trainable_stages(self, stages: int) -> None:
        """Fine-tune the last ``stages`` top-level children of the trunk (-1: all); freeze the rest."""
        children = self._stages()
        frozen = [] if stages < 0 else children[: max(0, len(children) - stages)]
        for child in children:
            child.requires_grad_(child not in frozen)
        self.frozen_stages = frozen

    def train(self, mode: bool = True) -> AnnotationEncoder:
        """``nn.Module.train``, but the frozen stages stay in eval mode, so their BatchNorm statistics are kept."""
        super().train(mode)
        for child in self.frozen_stages:  # frozen BatchNorm keeps its running statistics
            child.eval()
        return self

    def _stages(self) -> list[nn.Module]:
        return list(self.trunk.children()) if not isinstance(self.trunk, _TimmFeatures) else [self.trunk]

    def frozen_part(self) -> nn.Module | None:
        """The part whose output training never changes, to be cached: the frozen first stages (in eval mode), or,
        all frozen, the trunk with its pooling; None when nothing is frozen."""
        stages, frozen = self._stages(), len(self.frozen_stages)
        if not frozen:
            return None
        return nn.Sequential(self.trunk, self.pool) if frozen == len(stages) else nn.Sequential(*stages[:frozen])

    def frozen_features(self) -> FrozenPart | None:
        """``frozen_part`` with what names it besides its weights, for a feature cache (None: nothing frozen)."""
        part = self.frozen_part()
        return None if part is None else FrozenPart(part, {"backbone": self.backbone_name,
                                                           "frozen_stages": len(self.frozen_stages)})

    def _layout(self, inputs: Tensor) -> Tensor:
        channels_last = self.channels_last and inputs.dim() == 4  # NHWC: see the end of __init__
        return inputs.contiguous(memory_format=torch.channels_last) if channels_last else inputs

    def forward(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images (B, 3, H, W) -> annotation vectors (B, L, D) and the grid (Gh, Gw)."""
        return self._annotations(self.pool(self.trunk(self._layout(images))))  # (B, D, Gh, Gw)

    def from_frozen(self, features: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """``forward`` from a feature cache's fp16 output of ``frozen_part``: only the rest of the encoder runs."""
        features = self._layout(features).to(next(self.parameters()).dtype)  # fp16 from the cache: the weights' dtype
        stages, frozen = self._stages(), len(self.frozen_stages)
        if frozen < len(stages):
            for stage in stages[frozen:]:
                features = stage(features)
            features = self.pool(features)
        return self._annotations(features)

    def encode(self, inputs: Tensor, *, features: bool = False) -> tuple[Tensor, tuple[int, int]]:
        """``forward`` on images, or ``from_frozen`` on cached ``features``."""
        return self.from_frozen(inputs) if features else self(inputs)

    @staticmethod
    def _annotations(features: Tensor) -> tuple[Tensor, tuple[int, int]]:
        grid = (features.shape[-2], features.shape[-1])
        return features.flatten(2).transpose(1, 2), grid  # (B, D, Gh·Gw) -> (B, L, D)

    @torch.no_grad()
    def grid_for(self, image_size: int) -> tuple[int, int]:
        """The annotation grid for a square input of ``image_size`` (runs the trunk once on zeros)."""
        was_training = self.training
        self.eval()
        _, grid = self(torch.zeros(1, 3, image_size, image_size, device=next(self.parameters()).device))
        self.train(was_training)
        return grid


class EncoderClassifier(nn.Module):
    """An ``AnnotationEncoder`` with linear heads on the mean of the L vectors, p(class | image) = softmax(W · (1/L)
    Σ_i a_i + b), and the colour's with ``num_colours``: its pretraining, as the paper's VGG was on ImageNet."""

    def __init__(self, options: EncoderOptions | None = None, *, num_classes: int = 10, num_colours: int = 0,
                 image_size: int = 224, **fields: Any) -> None:
        super().__init__()
        self.encoder = AnnotationEncoder(options, image_size=image_size, **fields)
        self.head = nn.Linear(self.encoder.annotation_dim, num_classes)
        self.colour_head = nn.Linear(self.encoder.annotation_dim, num_colours) if num_colours else None

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        """Class logits (B, C) and colour logits (B, K) (None without a colour head) for images (B, 3, H, W)."""
        pooled = self.encoder(images)[0].mean(dim=1)
        return self.head(pooled), self.colour_head(pooled) if self.colour_head is not None else None
