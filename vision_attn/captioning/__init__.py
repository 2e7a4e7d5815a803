"""Show, Attend and Tell: annotation encoder, attention decoder, beam search, losses, the whole ``Captioner``,
its evaluation, and the LightningModule (``vision_attn.captioning.module.ShowAttendTell``)."""
