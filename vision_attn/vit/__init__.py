"""The patch-embedding Vision Transformer without Lightning: the model, its option groups, attention rollout, local
and timm weights, distillation, the trained classifier at work, and its maps drawn and scored. The LightningModule is
``vision_attn.tasks.ViTTask``."""

from vision_attn.vit.vision_transformer import VisionTransformer

__all__ = ["VisionTransformer"]
