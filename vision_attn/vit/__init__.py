"""Patch-embedding Vision Transformer: the model, attention rollout, local weights, inference, and the
LightningModule (``vision_attn.vit.module.ViTClassifier``)."""

from vision_attn.vit.model import VisionTransformer

__all__ = ["VisionTransformer"]
