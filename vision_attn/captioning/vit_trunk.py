"""This project's ViT as the captioner's encoder (``encoder.backbone: vit``): its patch tokens are the annotation
vectors. Its stages are the embedding, each block and the final norm (``trainable_stages: k`` fine-tunes the last
k), rebuilt for square RGB input: kernel adapted, position embedding resampled (``vit.pretrained``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

from vision_attn.checkpoint import extract_state_dict, hyper_parameters, load_file
from vision_attn.errors import CheckpointError
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.vision_transformer import VisionTransformer, prefix_tokens

# The ViT architecture of a weights file without hyper-parameters (timm's naming): timm's ViTs have 64 dims per
# head, so the heads are embed_dim / 64 unless the file is a `vision-attn fit` checkpoint that says otherwise.
TIMM_HEAD_DIM = 64
# What a captioner checkpoint keeps of its ViT's architecture (``EncoderOptions.vit``)
VIT_OPTIONS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "stem", "reg_tokens",
               "dist_token", "global_pool")


class ViTEmbedding(nn.Module):
    """z_0 = [x_cls; x_dist; x_reg; x_p E] + E_pos (Dosovitskiy et al. 2020, eq. 1): the first stage of a ViT trunk."""

    def __init__(self, vit: VisionTransformer) -> None:
        super().__init__()
        self.patch_embed, self.cls_token, self.dist_token, self.reg_token, self.pos_embed = (
            vit.patch_embed, vit.cls_token, vit.dist_token, vit.reg_token, vit.pos_embed)

    def forward(self, images: Tensor) -> Tensor:
        """z_0, (B, P + N, D): the P prefix tokens, then the N patch embeddings, plus the position embedding."""
        x = self.patch_embed(images)  # (B, N, D), the patches row by row
        prefix = prefix_tokens(self.cls_token, self.dist_token, self.reg_token, x.shape[0])
        return torch.cat([prefix, x], dim=1) + self.pos_embed  # (B, P + N, D)


class ViTPatchGrid(nn.Module):
    """The last stage: LN(z_L) of the patch tokens only (no cls, no registers), as a (B, D, Gh, Gw) map whose
    cell (r, c) is the patch at row r, column c of the image, so α_i with i = r·Gw + c lines up with it."""

    def __init__(self, norm: nn.Module, prefix_tokens: int, grid: tuple[int, int]) -> None:
        super().__init__()
        self.norm, self.prefix_tokens, self.grid = norm, prefix_tokens, grid

    def forward(self, tokens: Tensor) -> Tensor:
        """Tokens (B, P + N, D) -> the normalised patch tokens as a (B, D, Gh, Gw) map."""
        patches = self.norm(tokens[:, self.prefix_tokens :])  # (B, N, D)
        return patches.transpose(1, 2).reshape(patches.shape[0], -1, *self.grid)


class ViTTrunk(nn.Sequential):
    """A ``VisionTransformer``'s patch tokens as annotation vectors: stages embedding, block 1..L (each
    z_l = z'_l + MLP(LN(z'_l)), z'_l = z_{l-1} + MSA(LN(z_{l-1}))), final norm."""

    def __init__(self, vit: VisionTransformer) -> None:
        # the token pooling's LN is the final norm; a mean-pooling ViT normalises its mean (fc_norm) instead
        norm = vit.norm if isinstance(vit.norm, nn.LayerNorm) else vit.fc_norm
        super().__init__(ViTEmbedding(vit), *vit.blocks, ViTPatchGrid(norm, vit.num_prefix_tokens, vit.grid_size))
        self.out_channels = vit.embed_dim


def vit_trunk(source: str | os.PathLike | None, image_size: int, options: dict | None = None
              ) -> tuple[ViTTrunk, dict[str, Any], dict[str, Any]]:
    """The trunk for square RGB inputs of ``image_size``, its architecture and ``source``'s hyper-parameters: from a
    `vision-attn fit` ViT checkpoint or timm-format weights, or, without ``source``, untrained from the
    architecture a captioner checkpoint recorded (``options``), for its weights to fill."""
    if options and not source:
        vit = VisionTransformer(img_size=image_size, in_chans=3, num_classes=0, **options)
        return ViTTrunk(vit), dict(options), {}
    if not source:
        raise ValueError("backbone vit needs encoder.pretrained: a ViT checkpoint from `vision-attn fit` or a "
                         "timm-format ViT weights file (for timm's own models use backbone timm:vit_…)")
    loaded = load_file(source)
    hparams = hyper_parameters(loaded)
    state = extract_state_dict(loaded)
    if hparams and any(k.startswith("model.") for k in state):
        state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    if "pos_embed" not in state or not any(k.startswith("patch_embed.") for k in state):
        raise CheckpointError(f"{source}: not a ViT checkpoint or ViT weights (no pos_embed / patch_embed)")
    architecture = hparams.get("architecture") or {}
    options = {k: architecture[k] for k in VIT_OPTIONS if k in architecture} if hparams else architecture_of(state)
    if image_size % options["patch_size"]:
        raise ValueError(f"the captioner's image size {image_size} is not a multiple of the ViT's patch size "
                         f"{options['patch_size']}")
    vit = VisionTransformer(img_size=image_size, in_chans=3, num_classes=0, **options)
    try:
        load_pretrained(vit, source, state=state)
    except CheckpointError as error:
        raise CheckpointError(f"{error} (as the captioner's ViT encoder)") from None
    return ViTTrunk(vit), options, hparams


def architecture_of(state: dict[str, Tensor]) -> dict[str, Any]:
    """The ViT architecture of a timm-format state dict, read off its weights' shapes and names."""
    kernel = state["patch_embed.proj.weight"]
    embed_dim = kernel.shape[0]
    return {"patch_size": kernel.shape[-1], "embed_dim": embed_dim,
            "depth": 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
            "num_heads": max(1, embed_dim // TIMM_HEAD_DIM),
            "mlp_ratio": state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
            "qkv_bias": "blocks.0.attn.qkv.bias" in state,
            "reg_tokens": state["reg_token"].shape[1] if "reg_token" in state else 0,
            "dist_token": "dist_token" in state,
            "global_pool": "token" if "norm.weight" in state else "avg"}
