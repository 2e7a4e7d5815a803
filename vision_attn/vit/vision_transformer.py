"""Vision Transformer: "An Image is Worth 16x16 Words" (Dosovitskiy et al. 2020, arXiv 2010.11929): patch
embedding, cls token, position embedding, pre-LN blocks of self-attention, Softmax(QKᵀ/√d)V (Vaswani et al. 2017),
and MLPs, a linear head. Parameter names equal timm's, so timm state dicts load as they are."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def drop_path(x: Tensor, drop_prob: float, training: bool) -> Tensor:
    """Stochastic depth: drop the whole residual branch per sample (Huang et al. 2016)."""
    if drop_prob == 0.0 or not training:
        return x
    keep_prob = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep_prob)
    return x * mask / keep_prob


def patch_dropout(x: Tensor, drop_prob: float, training: bool, prefix_tokens: int = 1, *,
                  return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor | None]:
    """PatchDropout (Liu et al. 2023): in training, keep ``max(1, int(N (1 − p)))`` random patch tokens of each image
    and every prefix token; ``return_indices`` also returns the kept (B, K) indices (None when all are kept)."""
    if drop_prob == 0.0 or not training:
        return (x, None) if return_indices else x
    prefix, patches = x[:, :prefix_tokens], x[:, prefix_tokens:]
    batch, count, dim = patches.shape
    keep = max(1, int(count * (1.0 - drop_prob)))
    kept = torch.rand(batch, count, device=x.device).argsort(dim=1)[:, :keep]  # (B, keep) random patch indices
    patches = patches.gather(1, kept.unsqueeze(-1).expand(-1, -1, dim))
    x = torch.cat([prefix, patches], dim=1)
    return (x, kept) if return_indices else x


def prefix_tokens(cls_token: Tensor, dist_token: Tensor | None, reg_token: Tensor | None, batch: int) -> Tensor:
    """(B, P, D): the tokens before the patches, in timm's order: cls, distillation, registers."""
    tokens = [token for token in (cls_token, dist_token, reg_token) if token is not None]
    return torch.cat(tokens, dim=1).expand(batch, -1, -1)


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch tokens (B, N, D) by a conv with kernel = stride = patch size.

    ``stem="conv"``: a convolutional stem (Xiao et al. 2021) instead, log2(P) stride-2 convs with BatchNorm and ReLU
    (widths … D/2, D), then a 1×1 conv; same grid. Its convs are 4×4 with padding 1 (the paper's 3×3), so token
    (r, c) stays centred on patch (r, c) and maps drawn on the patch grid stay where the model looked.
    """

    def __init__(self, *, img_size: int, patch_size: int, in_chans: int, embed_dim: int,
                 stem: Literal["patch", "conv"] = "patch", channels_last: bool = False) -> None:
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        if stem == "patch":
            self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        elif stem == "conv":
            steps = patch_size.bit_length() - 1
            if patch_size < 2 or 2**steps != patch_size:
                raise ValueError(f"the conv stem needs a patch size that is a power of 2, got {patch_size}")
            widths = [max(1, embed_dim // 2 ** (steps - 1 - i)) for i in range(steps)]
            layers: list[nn.Module] = []
            for width_in, width in zip([in_chans, *widths[:-1]], widths, strict=True):
                layers += [nn.Conv2d(width_in, width, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                           nn.ReLU(inplace=True)]
            self.proj = nn.Sequential(*layers, nn.Conv2d(widths[-1], embed_dim, kernel_size=1))
        else:
            raise ValueError(f"unknown stem {stem!r}: use patch or conv")
        self.channels_last = channels_last  # NHWC convolutions: oneDNN's fast path on CPUs, the same maths
        if channels_last:
            self.proj.to(memory_format=torch.channels_last)

    def forward(self, x: Tensor, *, window: bool = False) -> Tensor:
        """``window``: ``x`` may be a patch-aligned window of the image, smaller than ``img_size``."""
        height, width = x.shape[-2:]
        if window:
            if height > self.img_size or width > self.img_size or height % self.patch_size or width % self.patch_size:
                raise ValueError(f"a {height}x{width} window does not fit the {self.img_size}x{self.img_size} "
                                 f"image in whole {self.patch_size}-pixel patches")
        elif (height, width) != (self.img_size, self.img_size):
            raise ValueError(f"input is {tuple(x.shape[-2:])} but the model expects {self.img_size}x{self.img_size}; "
                             "resize the input or build the model with that img_size")
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, D, Gh, Gw) -> (B, N, D)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0,
                                 return_weights: bool = False, fused: bool = True) -> tuple[Tensor, Tensor | None]:
    """Softmax(QKᵀ/√d)V over (B, H, N, d): the fused kernel, or the explicit path (``fused=False``: faster on a CPU
    for a few tokens), which alone gives the weights (B, H, N, N) when ``return_weights`` asks for them."""
    if fused and not return_weights:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p), None
    # (B, H, N, N), scaled in place: one pass less
    weights = torch.matmul(q, k.transpose(-2, -1)).mul_(q.shape[-1] ** -0.5).softmax(dim=-1)
    attended = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return attended @ v, weights


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (parameter names as in timm's ``Attention``)."""

    def __init__(self, dim: int, *, num_heads: int = 8, qkv_bias: bool = True, attn_drop: float = 0.0,
                 proj_drop: float = 0.0, fused: bool = True) -> None:
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"embed dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_drop, self.fused = attn_drop, fused
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        """Self-attention over the tokens, (B, N, D) -> (B, N, D), and with ``return_weights`` the attention weights
        (B, H, N, N) by the explicit Softmax(QKᵀ/√d)V (else None)."""
        batch, tokens, dim = x.shape  # qkv: (B, N, 3·D) -> (3, B, H, N, d)
        qkv = self.qkv(x).reshape(batch, tokens, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out, weights = scaled_dot_product_attention(*qkv.unbind(0), dropout_p=self.attn_drop if self.training else 0.0,
                                                    return_weights=return_weights, fused=self.fused)
        out = out.transpose(1, 2).reshape(batch, tokens, dim)  # (B, H, N, d) -> (B, N, D)
        return self.proj_drop(self.proj(out)), weights


def mlp(dim: int, hidden_dim: int, drop: float = 0.0) -> nn.Sequential:
    """The block's MLP on every token, (B, T, D) -> (B, T, D): fc1 -> GELU -> dropout -> fc2 -> dropout (timm's
    ``Mlp`` and its parameter names)."""
    return nn.Sequential(OrderedDict(fc1=nn.Linear(dim, hidden_dim), act=nn.GELU(), drop1=nn.Dropout(drop),
                                     fc2=nn.Linear(hidden_dim, dim), drop2=nn.Dropout(drop)))


class Block(nn.Module):
    """Pre-LN Transformer block: x + MSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, *, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop: float = 0.0,
                 attn_drop: float = 0.0, drop_path: float = 0.0, fused_attention: bool = True) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = MultiHeadSelfAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop,
                                           proj_drop=drop, fused=fused_attention)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.drop_path = drop_path

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """z'_l = z_{l-1} + MSA(LN(z_{l-1})), z_l = z'_l + MLP(LN(z'_l)) on (B, T, D), with stochastic depth; with
        ``return_weights``, also the attention weights (B, heads, T, T) it used (the explicit Softmax(QKᵀ/√d)V)."""
        attended, weights = self.attn(self.norm1(x), return_weights=return_weights)
        x = x + drop_path(attended, self.drop_path, self.training)  # z' = MSA(LN(z)) + z
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)  # z = MLP(LN(z')) + z'
        return (x, weights) if return_weights else x


def sincos_position_embedding(grid_size: tuple[int, int], dim: int, temperature: float = 10000.0) -> Tensor:
    """2-D sin-cos embedding (N, dim): a quarter of the channels each for sin(y), cos(y), sin(x), cos(x)."""
    if dim % 4:
        raise ValueError(f"sin-cos position embedding needs embed_dim divisible by 4, got {dim}")
    rows, cols = torch.meshgrid(torch.arange(grid_size[0], dtype=torch.float32),
                                torch.arange(grid_size[1], dtype=torch.float32), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    y, x = (grid.flatten()[:, None] * omega[None] for grid in (rows, cols))
    return torch.cat([y.sin(), y.cos(), x.sin(), x.cos()], dim=1)


class VisionTransformer(nn.Module):
    """ViT classifier. ``forward_features`` returns tokens, ``forward_head`` the logits; the attention weights come
    only through ``forward_intermediates`` or ``forward_with_attention`` (the others run the fused SDPA kernel).

    ``reg_tokens``: registers (Darcet et al. 2024), learnt tokens where attention with nowhere useful to go can rest.
    ``dist_token``: DeiT's distillation token (Touvron et al. 2021) with its own head; ``forward_head`` returns both
    heads' logits in training with ``distilled_training`` set, else their mean, as DeiT classifies.
    """

    def __init__(self, *, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, patch_drop_rate: float = 0.0,
                 global_pool: Literal["token", "avg"] = "token",
                 pos_embed_init: Literal["trunc_normal", "sincos"] = "trunc_normal", zero_init_head: bool = False,
                 fused_attention: bool = True, stem: Literal["patch", "conv"] = "patch", reg_tokens: int = 0,
                 dist_token: bool = False, channels_last: bool = False) -> None:
        super().__init__()
        if not 0.0 <= patch_drop_rate < 1.0:
            raise ValueError(f"patch_drop_rate must be in [0, 1), got {patch_drop_rate}")
        if reg_tokens < 0:
            raise ValueError(f"reg_tokens must be 0 or more, got {reg_tokens}")
        # the cls token, the distillation token, the registers, then the patches (timm's order)
        self.num_prefix_tokens = 1 + int(dist_token) + reg_tokens
        self.distilled_training = False  # set by the trainer: forward_head then returns (cls, distillation) logits
        self.num_classes, self.embed_dim = num_classes, embed_dim
        self.patch_drop_rate, self.global_pool = patch_drop_rate, global_pool
        self.pos_embed_init, self.zero_init_head = pos_embed_init, zero_init_head
        self.patch_embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
                                      stem=stem, channels_last=channels_last)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if dist_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + self.num_prefix_tokens, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList(  # stochastic depth rising linearly to drop_path_rate at the last block
            Block(embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                  attn_drop=attn_drop_rate, drop_path=rate, fused_attention=fused_attention)
            for rate in torch.linspace(0, drop_path_rate, depth).tolist()
        )
        # As in timm: the cls token gets the final norm; mean pooling normalises after pooling (fc_norm).
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "token" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if global_pool == "avg" else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = nn.Linear(embed_dim, num_classes) if dist_token and num_classes > 0 else None
        self.init_weights()

    @property
    def grid_size(self) -> tuple[int, int]:
        """(Gh, Gw), the patch grid of an ``img_size`` image."""
        return self.patch_embed.grid_size

    def init_weights(self) -> None:
        """E_pos truncated normal or 2-D sin-cos, prefix tokens near 0, Linears truncated normal (heads 0 if asked)."""
        if self.pos_embed_init == "sincos":  # fixed 2-D sin-cos start (Beyer et al. 2022); still learned
            with torch.no_grad():
                self.pos_embed.zero_()
                self.pos_embed[0, self.num_prefix_tokens :] = sincos_position_embedding(self.grid_size, self.embed_dim)
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for token in (self.cls_token, self.dist_token, self.reg_token):
            if token is not None:
                nn.init.normal_(token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.zero_init_head:
            for head in (self.head, self.head_dist):
                if isinstance(head, nn.Linear):
                    nn.init.zeros_(head.weight)  # every class starts equally likely

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """What AdamW leaves undecayed: the position embedding and the cls, distillation and register tokens."""
        tokens = {name for name in ("dist_token", "reg_token") if getattr(self, name) is not None}
        return {"pos_embed", "cls_token"} | tokens

    def embed(self, x: Tensor, *, window_origin: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Image -> (z_0 = [x_cls; x_p E] + E_pos (B, P + K, D), the (B, K) patches PatchDropout kept or None).
        ``window_origin`` (B, 2) [x, y] pixels: ``x`` is a window of an ``img_size`` image with its corner there."""
        window = None if window_origin is None else tuple(side // self.patch_embed.patch_size for side in x.shape[-2:])
        x = self.patch_embed(x, window=window is not None)  # (B, N, D)
        x = torch.cat([prefix_tokens(self.cls_token, self.dist_token, self.reg_token, x.shape[0]), x], dim=1)
        position = self.pos_embed if window is None else self.window_position_embedding(window_origin, window)
        x = self.pos_drop(x + position)  # z_0 = [x_cls; x_p E] + E_pos
        return patch_dropout(x, self.patch_drop_rate, self.training, prefix_tokens=self.num_prefix_tokens,
                             return_indices=True)

    def forward_features(self, x: Tensor, *, window_origin: Tensor | None = None) -> Tensor:
        """Image (B, C, H, W) -> tokens (B, P + N, D), the P = ``num_prefix_tokens`` first, by the fused kernel."""
        x, _ = self.embed(x, window_origin=window_origin)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_intermediates(self, x: Tensor, *, window_origin: Tensor | None = None
                              ) -> tuple[Tensor, list[Tensor], Tensor | None]:
        """``forward_features``'s tokens (B, P + K, D), with each block's attention (B, heads, T, T) and the (B, K)
        patches PatchDropout kept (None when all are kept)."""
        x, kept = self.embed(x, window_origin=window_origin)
        attentions = []
        for block in self.blocks:
            x, weights = block(x, return_weights=True)
            attentions.append(weights)
        return self.norm(x), attentions, kept

    def window_position_embedding(self, origin: Tensor, window: tuple[int, int]) -> Tensor:
        """(B, P + h·w, D): the prefix's position embeddings, then those of each h×w window at ``origin`` [x, y]."""
        patch = self.patch_embed.patch_size
        if bool((origin % patch).any()):
            raise ValueError(f"window origins must be multiples of the patch size ({patch}), got {origin.tolist()}")
        (rows, cols), (height, width) = self.grid_size, window
        top, left = (origin[:, 1] // patch).long(), (origin[:, 0] // patch).long()
        if bool((top < 0).any() | (left < 0).any() | (top + height > rows).any() | (left + width > cols).any()):
            raise ValueError(f"a {height}x{width}-patch window at {origin.tolist()} leaves the {rows}x{cols} grid")
        prefix = self.pos_embed[:, : self.num_prefix_tokens]
        grid = self.pos_embed[0, self.num_prefix_tokens :].view(rows, cols, -1)
        across = left[:, None] + torch.arange(width, device=origin.device)  # (B, w)
        down = top[:, None] + torch.arange(height, device=origin.device)  # (B, h)
        patches = grid[down[:, :, None], across[:, None, :]].flatten(1, 2)  # (B, h, w, D) -> (B, h·w, D)
        return torch.cat([prefix.expand(len(origin), -1, -1), patches], dim=1)

    def forward_head(self, x: Tensor, *, pre_logits: bool = False) -> Tensor:
        """Tokens (B, P + N, D) -> logits (B, classes), or the pooled features with ``pre_logits``."""
        # y = LN(z_L^0), or the mean of the patch tokens
        pooled = x[:, 0] if self.global_pool == "token" else x[:, self.num_prefix_tokens :].mean(dim=1)
        features = self.head_drop(self.fc_norm(pooled))
        if pre_logits or self.head_dist is None:
            return features if pre_logits else self.head(features)
        logits, distilled = self.head(features), self.head_dist(self.head_drop(x[:, 1]))  # DeiT: y_dist = W' z_L^dist
        if self.training and self.distilled_training:
            return logits, distilled
        return (logits + distilled) / 2

    def forward(self, x: Tensor) -> Tensor:
        """Image (B, C, H, W) -> logits (B, classes)."""
        return self.forward_head(self.forward_features(x))

    def forward_with_attention(self, x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """(logits, each block's attention (B, heads, T, T)): what rollout and the overlays read."""
        tokens, attentions, _ = self.forward_intermediates(x)
        return self.forward_head(tokens), attentions
