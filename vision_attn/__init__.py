"""vision-attn: Show, Attend and Tell captioning and a patch-embedding ViT, trained with Lightning."""

__version__ = "0.1.0"
