"""ViT weights from a local file (timm's or our own) or ``timm:<model name>[.<tag>]`` (timm's, from the Hugging Face
cache), adapted as timm's users expect: the first kernel summed (1 channel) or tiled for other input channels, the
position embedding resampled bicubically for another grid, the head left fresh for other classes."""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.checkpoint import extract_state_dict, load_file
from vision_attn.errors import CheckpointError
from vision_attn.vit.vision_transformer import VisionTransformer
from vision_attn.weights import is_weights_name, timm_pretrained_name, timm_weights

TIMM_PREFIX = "timm:"

log = logging.getLogger(__name__)


def resample_pos_embed(pos_embed: Tensor, new_grid: tuple[int, int], num_prefix_tokens: int = 1) -> Tensor:
    """(1, P + Gh·Gw, D) -> (1, P + Gh'·Gw', D): bicubic (antialiased) resampling of the grid part, prefix kept."""
    prefix, grid_part = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old_tokens, dim = grid_part.shape[1], grid_part.shape[2]
    old_side = math.isqrt(old_tokens)
    if old_side * old_side != old_tokens:
        raise CheckpointError(f"position embedding has {old_tokens} grid tokens, which is not a square grid")
    if (old_side, old_side) == tuple(new_grid):
        return pos_embed
    grid_part = grid_part.reshape(1, old_side, old_side, dim).permute(0, 3, 1, 2)  # (1, D, G, G)
    grid_part = F.interpolate(grid_part.float(), size=new_grid, mode="bicubic", align_corners=False, antialias=True)
    grid_part = grid_part.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim)  # (1, G'·G', D)
    return torch.cat([prefix, grid_part.to(pos_embed.dtype)], dim=1)


def adapt_input_conv(weight: Tensor, in_chans: int) -> Tensor:
    """Patch-embedding kernel (D, C, p, p) -> (D, in_chans, p, p), keeping the response to grey input."""
    old_chans = weight.shape[1]
    if old_chans == in_chans:
        return weight
    if in_chans == 1:
        return weight.sum(dim=1, keepdim=True)
    return weight.repeat(1, math.ceil(in_chans / old_chans), 1, 1)[:, :in_chans] * (old_chans / in_chans)


def resize_patch_kernel(weight: Tensor, patch_size: int) -> Tensor:
    """(D, C, p, p) -> (D, C, p', p') by bilinear resampling; used when the patch size changes."""
    if weight.shape[-1] == patch_size:
        return weight
    scale = (weight.shape[-1] / patch_size) ** 2
    return F.interpolate(weight.float(), size=(patch_size, patch_size), mode="bilinear") * scale


def load_pretrained(model: VisionTransformer, path: str | os.PathLike, *, state: dict[str, Tensor] | None = None
                    ) -> list[str]:
    """Load a weights file or ``timm:<model>[.<tag>]`` into ``model`` (``state``: the file's, already read); returns
    the keys left at their initial values."""
    if state is not None:
        state = dict(state)
    elif str(path).startswith(TIMM_PREFIX):
        state = timm_weights(timm_pretrained_name(str(path).removeprefix(TIMM_PREFIX))).state_dict
    elif is_weights_name(path) and _is_timm_model(str(path)):
        raise CheckpointError(f"{path}: no such file; for timm's weights of that model write {TIMM_PREFIX}{path}")
    else:
        state = extract_state_dict(load_file(path))
    own = model.state_dict()
    patch_key = "patch_embed.proj.weight"
    if patch_key in state:
        kernel = adapt_input_conv(state[patch_key], own[patch_key].shape[1])
        state[patch_key] = resize_patch_kernel(kernel, own[patch_key].shape[-1]).to(own[patch_key].dtype)
    stem_key = "patch_embed.proj.0.weight"  # the first conv of a conv stem (``stem: conv``)
    if stem_key in state and stem_key in own:
        state[stem_key] = adapt_input_conv(state[stem_key], own[stem_key].shape[1]).to(own[stem_key].dtype)
    if "pos_embed" in state and state["pos_embed"].shape != own["pos_embed"].shape:
        state["pos_embed"] = resample_pos_embed(state["pos_embed"], model.grid_size, model.num_prefix_tokens)
        log.info("resampled the position embedding of %s to a %dx%d grid", path, *model.grid_size)
    for key in ("head.weight", "head.bias"):
        if key in state and (key not in own or state[key].shape != own[key].shape):
            log.info("%s: %s has shape %s, the model needs %s; keeping a fresh head",
                     path, key, tuple(state[key].shape), tuple(own[key].shape) if key in own else None)
            del state[key]
    mismatched = [k for k in state if k in own and state[k].shape != own[k].shape]
    if mismatched:
        details = ", ".join(f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in mismatched[:3])
        raise CheckpointError(f"{path}: weights do not fit this ViT ({details}); check embed_dim/depth/heads")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise CheckpointError(f"{path}: keys this ViT does not have: {', '.join(unexpected[:5])}")
    if [k for k in missing if not k.startswith("head.")]:
        raise CheckpointError(f"{path}: weights missing for {', '.join(missing[:5])}; is this a ViT checkpoint?")
    return list(missing)


def _is_timm_model(name: str) -> bool:
    import timm
    return timm.is_model(name.partition(".")[0])
