"""The Vision Transformer without Lightning, its maps and weights (the LightningModule: ``tasks.ViTTask``)."""

from vision_attn.vit.vision_transformer import VisionTransformer

__all__ = ["VisionTransformer"]
