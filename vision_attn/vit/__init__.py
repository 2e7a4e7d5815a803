"""Patch-embedding Vision Transformer: model, attention rollout and LightningModule."""

from vision_attn.vit.model import VisionTransformer
from vision_attn.vit.module import ViTClassifier

__all__ = ["VisionTransformer", "ViTClassifier"]
