"""Where a ViT looks: last-layer attention, attention rollout, and gradient-weighted rollout.

Attention rollout (Abnar & Zuidema 2020): Â_l = rownorm(discard(fuse(A_l)) + I), R = Â_L · … · Â_1; row i of R is
how much each input token feeds output token i, and ``class_map`` reads the pooled token's row on the patches.
Gradient rollout (Chefer et al. 2021): R ← R + mean_h (A_h ⊙ ∂y_c/∂A_h)⁺ R from R = I, read as R − I (what flowed
between tokens: the gradients are small next to the identity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vision_attn.vit.vision_transformer import VisionTransformer

HeadFusion = Literal["mean", "max", "min"]
FUSIONS = {"mean": Tensor.mean, "max": Tensor.amax, "min": Tensor.amin}


def fuse_heads(attention: Tensor, fusion: HeadFusion = "mean") -> Tensor:
    """(B, H, N, N) -> (B, N, N) by the mean, max or min over heads."""
    if fusion not in FUSIONS:
        raise ValueError(f"unknown head fusion {fusion!r}: use mean, max or min")
    return FUSIONS[fusion](attention, dim=1)


def discard_weakest(attention: Tensor, ratio: float) -> Tensor:
    """Zero the lowest ``ratio`` fraction of each row of (B, N, N), never a row's own token (the diagonal)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"discard ratio must be in [0, 1), got {ratio}")
    count = int(ratio * attention.shape[-1])
    if count == 0:
        return attention
    eye = torch.eye(attention.shape[-1], dtype=torch.bool, device=attention.device)
    ranked = attention.masked_fill(eye, float("inf"))  # the diagonal ranks last, so it is never dropped
    weakest = ranked.topk(count, dim=-1, largest=False).indices
    return attention.scatter(-1, weakest, 0.0)


def rollout(fused: Sequence[Tensor], *, discard_ratio: float = 0.0) -> Tensor:
    """R = Â_L ··· Â_1 with Â_l = rownorm(discard(A_l) + I), for per-layer (B, N, N) maps, first layer first."""
    if not fused:
        raise ValueError("rollout needs the attention of at least one layer")
    eye = torch.eye(fused[0].shape[-1], dtype=fused[0].dtype, device=fused[0].device)
    result = eye.expand_as(fused[0]).clone()
    for attention in fused:
        attention = discard_weakest(attention, discard_ratio) + eye  # the residual connection
        attention = attention / attention.sum(dim=-1, keepdim=True)
        result = attention @ result
    return result


def attention_rollout(attentions: Sequence[Tensor], *, head_fusion: HeadFusion = "mean",
                      discard_ratio: float = 0.0) -> Tensor:
    """Rollout of per-layer (B, H, N, N) attention: (B, N, N)."""
    return rollout([fuse_heads(a, head_fusion) for a in attentions], discard_ratio=discard_ratio)


def gradient_rollout(attentions: Sequence[Tensor], gradients: Sequence[Tensor]) -> Tensor:
    """R − I, with R = I then R ← R + mean_h (A ⊙ ∂y_c/∂A)⁺ · R per layer, first layer first: (B, N, N)."""
    eye = torch.eye(attentions[0].shape[-1], dtype=attentions[0].dtype, device=attentions[0].device)
    relevance = eye.expand(len(attentions[0]), -1, -1).clone()
    for attention, gradient in zip(attentions, gradients, strict=True):
        relevance = relevance + (attention * gradient).clamp(min=0).mean(dim=1) @ relevance
    return relevance - eye


def pooled_weights(matrix: Tensor, global_pool: str = "token", prefix_tokens: int = 1) -> Tensor:
    """(B, T, T) token weights -> the pooled token's on the patches (B, T − P): cls row, or the patch rows' mean."""
    rows = matrix[:, 0] if global_pool == "token" else matrix[:, prefix_tokens:].mean(dim=1)
    return rows[:, prefix_tokens:]


def class_map(matrix: Tensor, grid: tuple[int, int], global_pool: str = "token", prefix_tokens: int = 1) -> Tensor:
    """``pooled_weights`` of (B, N, N) token-to-token weights shaped into the patch grid: (B, Gh, Gw)."""
    patches = pooled_weights(matrix, global_pool, prefix_tokens)
    if patches.shape[-1] != grid[0] * grid[1]:
        raise ValueError(f"{patches.shape[-1]} patch tokens do not fill a {grid[0]}x{grid[1]} grid")
    return patches.reshape(-1, *grid)


def last_layer_maps(attentions: Sequence[Tensor], grid: tuple[int, int], global_pool: str = "token",
                    prefix_tokens: int = 1) -> Tensor:
    """Last-layer attention of the pooled token(s) to the patches, per head: (B, H, Gh, Gw)."""
    last = attentions[-1]  # (B, H, T, T) -> (B·H, T, T), a map per head
    return class_map(last.flatten(0, 1), grid, global_pool, prefix_tokens).unflatten(0, last.shape[:2])


@dataclass
class AttentionMaps:
    """A batch's logits and where the classifier looked, each map over the patch grid (Gh, Gw)."""

    logits: Tensor  # (B, C)
    heads: Tensor  # (B, H, Gh, Gw): the last layer's attention of the pooled token(s), per head
    rollout: Tensor  # (B, Gh, Gw)
    gradient_rollout: Tensor | None = None  # (B, Gh, Gw), for the class asked for


def explain(model: VisionTransformer, images: Tensor, *, head_fusion: HeadFusion = "mean",
            discard_ratio: float = 0.0, gradient_class: int | Tensor | Literal["predicted"] | None = None
            ) -> AttentionMaps:
    """Logits and attention maps for a batch; the gradient rollout too for ``gradient_class``: one class, (B,)
    classes, or ``"predicted"`` (each image's top class)."""
    grid, pool, prefix = model.grid_size, model.global_pool, model.num_prefix_tokens
    with torch.enable_grad() if gradient_class is not None else torch.no_grad():
        logits, attentions = model.forward_with_attention(images)
        detached = [a.detach() for a in attentions]
        rolled = attention_rollout(detached, head_fusion=head_fusion, discard_ratio=discard_ratio)
        maps = AttentionMaps(logits.detach(), last_layer_maps(detached, grid, pool, prefix),
                             class_map(rolled, grid, pool, prefix))
        if gradient_class is not None:
            if isinstance(gradient_class, str) and gradient_class == "predicted":
                classes = logits.detach().argmax(dim=-1)
            else:
                classes = torch.as_tensor(gradient_class, device=logits.device).expand(logits.shape[0])
            if not bool(((classes >= 0) & (classes < logits.shape[-1])).all()):
                raise ValueError(f"class {gradient_class} is not one of the model's {logits.shape[-1]} classes")
            gradients = torch.autograd.grad(logits.gather(1, classes[:, None]).sum(), attentions)
            maps.gradient_rollout = class_map(gradient_rollout(detached, gradients), grid, pool, prefix)
    return maps
