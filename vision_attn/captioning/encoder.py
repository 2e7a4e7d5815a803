"""The annotation-vector encoder of "Show, Attend and Tell" (Xu et al. 2015, §3.1.1).

A CNN trunk turns an image into a grid of conv features; each of the L = Gh·Gw cells is an annotation
vector a_i ∈ R^D. The paper uses VGG-19's conv5_4 (14×14×512 at 224 px). Also here: ResNet-50/101
(layer4, optionally pooled to a chosen grid), any timm backbone through ``features_only``, a small CNN
that learns on a CPU in minutes, and this project's own Vision Transformer (``backbone: vit``), whose patch
tokens are the annotation vectors, as modern captioners attend over ViT patch tokens. Pretrained weights are a
local file, or a name (``imagenet``, a torchvision enum member, a timm tag) that torchvision or timm resolve in
their own caches (``vision_attn.weights``).
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import torch
from torch import Tensor, nn

from vision_attn.checkpoint import extract_state_dict, load_file
from vision_attn.errors import CheckpointError
from vision_attn.vit.model import VisionTransformer, prefix_tokens
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.weights import (
    TORCHVISION_BACKBONES,
    create_timm_model,
    is_weights_name,
    no_named_weights,
    timm_pretrained_name,
    torchvision_weights,
)

log = logging.getLogger(__name__)

Backbone = Literal["small", "vgg19", "resnet50", "resnet101", "vit"] | str


class _ViTEmbedding(nn.Module):
    """z_0 = [x_cls; x_dist; x_reg; x_p E] + E_pos (Dosovitskiy et al. 2020, eq. 1): the first stage of a ViT
    trunk."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.patch_embed, self.cls_token, self.dist_token, self.reg_token, self.pos_embed = (
            vit.patch_embed, vit.cls_token, vit.dist_token, vit.reg_token, vit.pos_embed)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)  # (B, N, D), the patches row by row
        prefix = prefix_tokens(self.cls_token, self.dist_token, self.reg_token, x.shape[0])
        return torch.cat([prefix, x], dim=1) + self.pos_embed  # (B, P + N, D)


class _ViTBlock(nn.Module):
    """One pre-LN transformer block of the trunk, z_l = z'_l + MLP(LN(z'_l)), z'_l = z_{l-1} + MSA(LN(z_{l-1}))."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, tokens: Tensor) -> Tensor:
        return self.block(tokens)[0]


class _ViTPatchGrid(nn.Module):
    """The last stage: LN(z_L) of the patch tokens only (no cls, no registers), as a (B, D, Gh, Gw) map whose
    cell (r, c) is the patch at row r, column c of the image, so α_i with i = r·Gw + c lines up with it."""

    def __init__(self, norm: nn.Module, prefix_tokens: int, grid: tuple[int, int]) -> None:
        super().__init__()
        self.norm, self.prefix_tokens, self.grid = norm, prefix_tokens, grid

    def forward(self, tokens: Tensor) -> Tensor:
        patches = self.norm(tokens[:, self.prefix_tokens :])  # (B, N, D)
        return patches.transpose(1, 2).reshape(patches.shape[0], -1, *self.grid)


class ViTTrunk(nn.Sequential):
    """A ``VisionTransformer``'s patch tokens as annotation vectors: stages embedding, block 1..L, final norm, so
    ``trainable_stages: k`` fine-tunes the last k of them (1: the final norm; 2: it and the last block; ...)."""

    def __init__(self, vit: VisionTransformer) -> None:
        # the token pooling's LN is the final norm; a mean-pooling ViT normalises its mean (fc_norm) instead
        norm = vit.norm if isinstance(vit.norm, nn.LayerNorm) else vit.fc_norm
        super().__init__(_ViTEmbedding(vit), *(_ViTBlock(block) for block in vit.blocks),
                         _ViTPatchGrid(norm, vit.num_prefix_tokens, vit.grid_size))
        self.out_channels = vit.embed_dim


# The ViT architecture of a weights file without hyper-parameters (timm's naming): timm's ViTs have 64 dims per
# head, so the heads are embed_dim / 64 unless the file is a `vision-attn fit` checkpoint that says otherwise.
TIMM_HEAD_DIM = 64


VIT_OPTIONS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "stem", "reg_tokens",
               "dist_token", "global_pool")


def _vit_trunk(source: str | os.PathLike | None, image_size: int, options: dict | None = None
               ) -> tuple[ViTTrunk, dict, dict]:
    """The ViT trunk for ``image_size`` square inputs of 3 channels, from a `vision-attn fit` ViT checkpoint or a
    timm-format ViT state dict (``source``); the patch kernel is adapted to RGB and the position embedding
    resampled to the new grid (``vit.pretrained.load_pretrained``). Without ``source``, ``options`` (the
    architecture a captioner checkpoint recorded) builds it untrained, for the checkpoint's weights to fill.
    Returns the trunk, its architecture and the source's hyper-parameters ({} for a bare state dict)."""
    if options and not source:
        vit = VisionTransformer(img_size=image_size, in_chans=3, num_classes=0, **options)
        return ViTTrunk(vit), dict(options), {}
    if not source:
        raise ValueError("backbone vit needs pretrained_encoder: a ViT checkpoint from `vision-attn fit` or a "
                         "timm-format ViT weights file (for timm's own models use backbone timm:vit_…)")
    loaded = load_file(source)
    hparams = dict(loaded.get("hyper_parameters") or {}) if isinstance(loaded, dict) else {}
    state = extract_state_dict(loaded)
    if hparams and any(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if "pos_embed" not in state or not any(k.startswith("patch_embed.") for k in state):
        raise CheckpointError(f"{source}: not a ViT checkpoint or ViT weights (no pos_embed / patch_embed)")
    if hparams:
        options = {k: hparams[k] for k in VIT_OPTIONS if k in hparams}
    else:
        kernel = state["patch_embed.proj.weight"]
        embed_dim = kernel.shape[0]
        options = {"patch_size": kernel.shape[-1], "embed_dim": embed_dim,
                   "depth": 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
                   "num_heads": max(1, embed_dim // TIMM_HEAD_DIM),
                   "mlp_ratio": state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
                   "qkv_bias": "blocks.0.attn.qkv.bias" in state,
                   "reg_tokens": state["reg_token"].shape[1] if "reg_token" in state else 0,
                   "dist_token": "dist_token" in state,
                   "global_pool": "token" if "norm.weight" in state else "avg"}
    if image_size % options["patch_size"]:
        raise ValueError(f"the captioner's image_size {image_size} is not a multiple of the ViT's patch size "
                         f"{options['patch_size']}")
    vit = VisionTransformer(img_size=image_size, in_chans=3, num_classes=0, **options)
    try:
        load_pretrained(vit, source, state=state)
    except CheckpointError as error:
        raise CheckpointError(f"{error} (as the captioner's ViT encoder)") from None
    return ViTTrunk(vit), options, hparams


class SmallCNN(nn.Sequential):
    """A CPU-sized trunk: S×S×3 -> S/stride × S/stride × 8·width, one conv-BN-ReLU per stage.

    Strides 2, 2 then 2×2 max-pools twice (stride 16; the receptive field, ~50 px, covers one Fashion-MNIST
    item), or once (stride 8: a grid twice as fine whose ~35 px receptive field stays within one item's cell).
    """

    def __init__(self, width: int = 32, in_chans: int = 3, *, stride: int = 16) -> None:
        if stride not in (8, 16):
            raise ValueError(f"the small CNN's output stride is 8 or 16, got {stride}")

        def stage(inputs: int, outputs: int, *, stride: int = 1, pool: bool = False) -> nn.Sequential:
            layers: list[nn.Module] = [
                nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(outputs),
                nn.ReLU(inplace=True),
            ]
            return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)

        super().__init__(
            stage(in_chans, width, stride=2),
            stage(width, 2 * width, stride=2),
            stage(2 * width, 4 * width, pool=True),
            stage(4 * width, 8 * width, pool=stride == 16),
        )
        self.out_channels = 8 * width


# torchvision and timm are imported by the backbones that need them: importing torchvision costs about 2 s,
# which the small CNN (and so captioning a photo with the default model) does not pay.
def _vgg19_conv5_4() -> tuple[nn.Sequential, int]:
    import torchvision

    features = torchvision.models.vgg19(weights=None).features
    return features[:36], 512  # up to the ReLU after conv5_4, before the last max-pool


def _resnet_layer4(depth: int) -> tuple[nn.Sequential, int]:
    import torchvision

    resnet = getattr(torchvision.models, f"resnet{depth}")(weights=None)
    stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool)
    return nn.Sequential(stem, resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4), 2048


class _TimmFeatures(nn.Module):
    """The last feature map of a timm backbone built with ``features_only``; with ``weights``
    (``<architecture>.<tag>``), loaded by timm from its cache."""

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
    """A timm model's (or our timm trunk's) state dict under the names of our ``features_only`` trunk. timm's
    feature wrappers rename: FeatureListNet flattens ``stages.0`` to ``stages_0``, FeatureGetterNet nests the
    model under ``model.``; a key keeps its name when no trunk key matches it up to those changes."""

    def plain(key: str) -> str:
        return key.removeprefix("body.").replace(".", "_")

    trunk_names = {plain(k.removeprefix("body.model.")): k for k in own} | {plain(k): k for k in own}
    return {trunk_names.get(plain(k), k if k.startswith("body.") else f"body.{k}"): v for k, v in state.items()}


class AnnotationEncoder(nn.Module):
    """Image (B, 3, H, W) -> annotation vectors (B, L, D) over a Gh×Gw grid.

    ``backbone`` is "small", "vgg19", "resnet50", "resnet101", "vit" or "timm:<model name>". ``grid_size`` pools the
    feature map to a fixed grid (None keeps the trunk's own). ``trainable_stages`` fine-tunes only the last N
    top-level stages of the trunk (-1: all, 0: frozen). ``small_stride`` (8 or 16) sets the small CNN's grid.
    ``pretrained`` is a local weights file, or a weights name: ``imagenet`` (torchvision's DEFAULT, i.e.
    VGG19_Weights.IMAGENET1K_V1 and ResNet50/101_Weights.IMAGENET1K_V2; for timm, what ``pretrained=True``
    loads), a member of the torchvision enum (``IMAGENET1K_V1``) or a timm tag (``a1_in1k``). Names are found in
    torch.hub's and the Hugging Face caches (``vision_attn.weights``); the small CNN has none.
    ``vit`` needs ``pretrained``: a `vision-attn fit` ViT checkpoint or a timm-format ViT weights file; it is
    rebuilt for ``image_size`` RGB inputs (``_vit_trunk``), its stages are the embedding, each block and the final
    norm, and its annotation vectors are the patch tokens on the ViT's patch grid. ``vit_options`` is the
    architecture built; a captioner checkpoint stores it as ``vit`` and is rebuilt from it without the file.
    """

    def __init__(
        self,
        *,
        backbone: Backbone = "small",
        width: int = 32,
        grid_size: int | None = None,
        pretrained: str | os.PathLike | None = None,
        trainable_stages: int = -1,
        small_stride: int = 16,
        image_size: int = 224,
        vit: dict | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.backbone_name = backbone
        named = is_weights_name(pretrained) and backbone != "vit"
        self.pretrained_with: dict = {}
        if backbone == "small":
            self.trunk: nn.Module = SmallCNN(width, stride=small_stride)
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
        elif backbone == "vit":
            self.trunk, self.vit_options, vit_hparams = _vit_trunk(pretrained, image_size, vit)
            self.annotation_dim = self.trunk.out_channels
            if pretrained:
                log.info("ViT encoder from %s: a %dx%d grid of %d-dim patch tokens (the ViT was trained at %s px)",
                         pretrained, *self.trunk[-1].grid, self.annotation_dim, vit_hparams.get("image_size", "?"))
            pretrained = None  # loaded
        else:
            raise ValueError(f"unknown backbone '{backbone}': use small, vgg19, resnet50, resnet101, vit or "
                             "timm:<name>")
        self.pool = nn.AdaptiveAvgPool2d(grid_size) if grid_size else nn.Identity()
        self.cached_input = False  # True: forward reads what ``frozen_part`` made of the images (a feature cache)
        if named:
            self.use_named_weights(str(pretrained))
        elif pretrained:
            self.load_trunk_weights(pretrained)
        self.set_trainable_stages(trainable_stages)
        # NHWC convolutions: oneDNN's fast path on CPUs (the small CNN's training step is ~30% faster on 2 cores),
        # and tensor cores' under mixed precision on GPUs. Loading weights keeps this layout (copy_ keeps strides).
        self.channels_last = channels_last
        if channels_last:
            self.trunk.to(memory_format=torch.channels_last)

    def load_trunk_weights(self, path: str | os.PathLike) -> None:
        """Load a torchvision/timm state dict (or our own trunk's, or the trunk of a ``vision-attn fit`` encoder
        pretraining or captioner checkpoint) from a local file; classifier keys are skipped. The file's
        Lightning hyperparameters, if any, are kept as ``pretrained_with`` (the normalisation it learnt under)."""
        loaded = load_file(path)
        state = extract_state_dict(loaded)
        if any(k.startswith("encoder.trunk.") for k in state):  # a vision-attn encoder pretraining or captioner
            state = {k.removeprefix("encoder.trunk."): v for k, v in state.items() if k.startswith("encoder.trunk.")}
        self.pretrained_with = dict(loaded.get("hyper_parameters") or {})
        self._load_trunk_state(state, path)

    def use_named_weights(self, name: str) -> None:
        """Load the weights called ``name`` through torchvision (its cache: ``$TORCH_HOME/hub/checkpoints``), or,
        for a timm trunk, keep what timm loaded when building it; ``pretrained_with`` becomes the normalisation
        they were trained under."""
        if self.backbone_name in TORCHVISION_BACKBONES:
            weights = torchvision_weights(self.backbone_name, name)
            self._load_trunk_state(weights.state_dict, weights.source)
            mean, std = weights.mean, weights.std
        elif isinstance(self.trunk, _TimmFeatures):
            config = self.trunk.body.pretrained_cfg
            mean, std = list(config["mean"]), list(config["std"])
        else:
            raise no_named_weights(self.backbone_name, name)
        self.pretrained_with = {"mean": mean, "std": std}

    def _load_trunk_state(self, state: dict[str, Tensor], source: str | os.PathLike) -> None:
        """Load a torchvision/timm/own trunk state dict into the trunk, refusing one that does not fit it."""
        own = self.trunk.state_dict()
        if self.backbone_name == "vgg19":  # torchvision names: features.N.*
            state = {k.removeprefix("features."): v for k, v in state.items()}
        elif self.backbone_name.startswith("resnet"):  # torchvision names: conv1, bn1, layer1..4, fc
            renamed = {"conv1": "0.0", "bn1": "0.1", "layer1": "1", "layer2": "2", "layer3": "3", "layer4": "4"}
            state = {
                renamed[k.split(".", 1)[0]] + "." + k.split(".", 1)[1]: v
                for k, v in state.items() if k.split(".", 1)[0] in renamed
            }
        elif self.backbone_name.startswith("timm:"):
            state = _timm_trunk_names(state, own)
        usable = {k: v for k, v in state.items() if k in own}
        if not usable:
            raise CheckpointError(f"{source}: no weights match the {self.backbone_name} trunk")
        wrong = [k for k, v in usable.items() if v.shape != own[k].shape]
        if wrong:
            raise CheckpointError(f"{source}: shapes differ for {', '.join(wrong[:3])}; is it a {self.backbone_name}?")
        missing = [k for k in own if k not in usable and not k.endswith("num_batches_tracked")]
        if missing:
            raise CheckpointError(f"{source}: {len(missing)} trunk weights missing, e.g. {missing[0]}")
        self.trunk.load_state_dict(usable, strict=False)
        log.info("loaded %d trunk tensors from %s", len(usable), source)

    def set_trainable_stages(self, stages: int) -> None:
        """Fine-tune the last ``stages`` top-level children of the trunk (-1: all); freeze the rest."""
        children = list(self.trunk.children()) if not isinstance(self.trunk, _TimmFeatures) else [self.trunk]
        frozen = [] if stages < 0 else children[: max(0, len(children) - stages)]
        for child in children:
            child.requires_grad_(child not in frozen)
        self.frozen_stages = frozen

    def train(self, mode: bool = True) -> AnnotationEncoder:
        super().train(mode)
        for child in self.frozen_stages:  # frozen BatchNorm keeps its running statistics
            child.eval()
        return self

    def _stages(self) -> list[nn.Module]:
        return list(self.trunk.children()) if not isinstance(self.trunk, _TimmFeatures) else [self.trunk]

    def frozen_part(self) -> nn.Module | None:
        """What of the encoder gives the same output all through training, so that it can be cached: the frozen
        first stages of the trunk, or, when every stage is frozen, the trunk with its grid pooling. None when
        nothing is frozen. Frozen stages run in eval mode (BatchNorm keeps its statistics), without gradient."""
        stages, frozen = self._stages(), len(self.frozen_stages)
        if not frozen:
            return None
        return nn.Sequential(self.trunk, self.pool) if frozen == len(stages) else nn.Sequential(*stages[:frozen])

    def forward(self, images: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """Images (B, 3, H, W) -> annotation vectors (B, L, D) and the grid; with ``cached_input`` set, the input
        is what ``frozen_part`` made of the images (a feature cache), and only the rest of the encoder runs."""
        if self.channels_last and images.dim() == 4:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.cached_input:
            stages, frozen = self._stages(), len(self.frozen_stages)
            features = images.to(next(self.parameters()).dtype)  # fp16 from the cache -> the weights' dtype
            if frozen < len(stages):
                for stage in stages[frozen:]:
                    features = stage(features)
                features = self.pool(features)
        else:
            features = self.pool(self.trunk(images))  # (B, D, Gh, Gw)
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
    """An ``AnnotationEncoder`` (B, 3, H, W) -> (B, L, D) with linear classifiers on the mean of the L vectors:
    the class, and (``num_colours`` > 0) the colour, of the object in the image. How the encoder is pretrained
    before captioning (``captioning.pretraining``), as the paper's VGG was on ImageNet:
    p(class | image) = softmax(W · (1/L) Σ_i a_i + b)."""

    def __init__(self, *, backbone: str = "small", encoder_width: int = 32, encoder_stride: int = 16,
                 num_classes: int = 10, num_colours: int = 0, channels_last: bool = False) -> None:
        super().__init__()
        self.encoder = AnnotationEncoder(backbone=backbone, width=encoder_width, small_stride=encoder_stride,
                                         channels_last=channels_last)
        self.head = nn.Linear(self.encoder.annotation_dim, num_classes)
        self.colour_head = nn.Linear(self.encoder.annotation_dim, num_colours) if num_colours else None

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor | None]:
        pooled = self.encoder(images)[0].mean(dim=1)
        return self.head(pooled), self.colour_head(pooled) if self.colour_head is not None else None
