"""Show, Attend and Tell: annotation encoder, attention decoder, beam search, LightningModule, vocabulary."""

from vision_attn.captioning.module import ShowAttendTell

__all__ = ["ShowAttendTell"]
