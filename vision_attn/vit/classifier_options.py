"""The classifiers' option groups: the ViT's and the ConvNet's architectures, their training, DeiT's distillation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vision_attn.option_groups import OptionGroup, at_most, finite, require


@dataclass(frozen=True)
class ViTArchitecture(OptionGroup):
    """The Vision Transformer (Dosovitskiy et al. 2020; ``vit/vision_transformer.py``): its field names are the
    ``VisionTransformer`` arguments, which are timm's."""

    name = "architecture"
    patch_size: int = 4
    """P: the image is cut into P×P patches, one token each"""
    embed_dim: int = 64
    """D, the tokens' width"""
    depth: int = 6
    """transformer blocks"""
    num_heads: int = 4
    """attention heads per block (D must divide by it)"""
    mlp_ratio: float = 4.0
    """the MLP's hidden width as a multiple of D"""
    qkv_bias: bool = True
    """biases in the q, k, v projection"""
    global_pool: Literal["token", "avg"] = "token"
    """the classifier reads the cls token, or the mean of the patch tokens"""
    pos_embed_init: Literal["trunc_normal", "sincos"] = "trunc_normal"
    """the learnt position embedding starts random, or at 2-D sin-cos (Beyer et al. 2022)"""
    zero_init_head: bool = False
    """the head starts at zero: every class equally likely"""
    fused_attention: bool = True
    """the fused SDPA kernel (false: the explicit Softmax(QKᵀ/√d)V, faster on a CPU for a few tokens)"""
    stem: Literal["patch", "conv"] = "patch"
    """patch: one P×P conv; conv: a small convolutional stem (Xiao et al. 2021), same grid"""
    reg_tokens: int = 0
    """registers, tokens that hold no patch (Darcet et al. 2024)"""
    dist_token: bool = False
    """DeiT's distillation token with its own head (Touvron et al. 2021)"""
    channels_last: bool = False
    """NHWC convolutions in the patch embedding: the same maths, faster on CPUs"""

    def check(self) -> None:
        """Refuse sizes out of range, heads not dividing embed_dim, an mlp_ratio ≤ 0, negative registers."""
        for key in ("patch_size", "embed_dim", "depth", "num_heads"):
            require(getattr(self, key) >= 1, self.name, f"{key} must be at least 1, got {getattr(self, key)}")
        for key, high, why in (("patch_size", 256, "a patch larger than that is most of any image here"),
                               ("embed_dim", 8192, "a wider token only costs memory here"),
                               ("depth", 256, "each block costs memory and time"),
                               ("num_heads", 256, "each head costs memory per token pair"),
                               ("reg_tokens", 256, "each register costs memory like a patch")):
            at_most(self.name, key, getattr(self, key), high, why)
        require(self.embed_dim % self.num_heads == 0, self.name,
                f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        require(finite(self.mlp_ratio) and self.mlp_ratio > 0, self.name,
                f"mlp_ratio must be above 0, got {self.mlp_ratio}")
        require(self.reg_tokens >= 0, self.name, f"reg_tokens must be 0 or more, got {self.reg_tokens}")


@dataclass(frozen=True)
class ConvNetArchitecture(OptionGroup):
    """The small VGG-shaped CNN that teaches the ViT (``vit/convnet.py``)."""

    name = "architecture"
    widths: list[int] = field(default_factory=lambda: [32, 64, 128])
    """the channels of each stage (two 3×3 conv-BN-ReLU layers each, 2×2 max pooling between)"""

    def check(self) -> None:
        """Refuse an empty list of widths or a width below 1."""
        require(len(self.widths) > 0 and all(width >= 1 for width in self.widths), self.name,
                f"widths must be one or more positive channel counts, got {list(self.widths)}")
        require(len(self.widths) <= 16 and all(width <= 8192 for width in self.widths), self.name,
                f"widths must be at most 16 stages of at most 8192 channels (more only costs memory), got "
                f"{list(self.widths)}")


@dataclass(frozen=True)
class ClassifierTraining(OptionGroup):
    """What training does to a classifier: dropout before its head, and label smoothing."""

    name = "training"
    rates = ("drop_rate", "label_smoothing")  # each from 0 to below 1
    drop_rate: float = 0.0
    """dropout (the ViT: after the position embedding, in the MLPs and before the head)"""
    label_smoothing: float = 0.0
    """the cross-entropy's label smoothing"""

    def check(self) -> None:
        """Refuse a dropout or a label smoothing (the ``rates``) outside [0, 1)."""
        for key in self.rates:
            require(finite(getattr(self, key)) and 0 <= getattr(self, key) < 1, self.name,
                    f"{key} must be from 0 to below 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class ViTTraining(ClassifierTraining):
    """What training does to the ViT: the classifier's dropout and label smoothing, attention dropout, stochastic
    depth, PatchDropout and its schedule, and attention grounding."""

    rates = (*ClassifierTraining.rates, "attn_drop_rate", "drop_path_rate", "patch_drop_rate")
    attn_drop_rate: float = 0.0
    """dropout on the attention weights"""
    drop_path_rate: float = 0.0
    """stochastic depth of the last block (0 at the first, linear in between)"""
    patch_drop_rate: float = 0.0
    """PatchDropout (Liu et al. 2023): the share of patch tokens a training image drops"""
    patch_drop_rate_end: float | None = None
    """PatchDropout's rate at the end of the run, linear in the run's progress from patch_drop_rate (null: fixed)"""
    attention_grounding: float = 0.0
    """+ this × −log(the share of the rollout on the object's box), with training batches that carry boxes"""

    def check(self) -> None:
        """Also refuse a patch_drop_rate_end outside [0, 1), a negative attention_grounding."""
        super().check()
        end = self.patch_drop_rate_end
        require(end is None or (finite(end) and 0.0 <= end < 1.0), self.name,
                f"patch_drop_rate_end must be in [0, 1), got {end}")
        require(finite(self.attention_grounding) and self.attention_grounding >= 0, self.name,
                f"attention_grounding must be 0 or more, got {self.attention_grounding}")


@dataclass(frozen=True)
class Distillation(OptionGroup):
    """DeiT's distillation (Touvron et al. 2021) from a trained ``teacher`` on the same data and normalisation:
    hard, L = (1 − λ) CE(ψ(Z_s), y) + λ CE(ψ(Z_d), argmax Z_t); soft, λ τ² KL(ψ(Z_t / τ) ‖ ψ(Z_d / τ)) in place of
    the second term. With the architecture's dist_token the distillation token's head learns the teacher."""

    name = "distillation"
    teacher: str | None = None
    """a `vision-attn fit` checkpoint of a ConvNetTask (DeiT's choice) or of a ViT (null: no distillation)"""
    mode: Literal["hard", "soft"] = "hard"
    """hard: the teacher's argmax as a label (DeiT's best); soft: its softened distribution"""
    weight: float = 0.5
    """λ, the teacher's share of the loss"""
    tau: float = 1.0
    """τ, the soft mode's temperature"""

    def check(self) -> None:
        """Refuse an unknown mode, a λ outside [0, 1], or a τ not above 0."""
        require(self.mode in ("hard", "soft"), self.name, f"mode must be 'hard' or 'soft', got {self.mode!r}")
        require(finite(self.weight) and 0.0 <= self.weight <= 1.0 and finite(self.tau) and self.tau > 0, self.name,
                f"weight must be in [0, 1] and tau above 0, got {self.weight} and {self.tau}")
