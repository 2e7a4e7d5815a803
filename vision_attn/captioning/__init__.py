"""Show, Attend and Tell without Lightning: the option groups, annotation encoder, attention decoder, beam search,
the whole ``Captioner``, its objectives (likelihood, REINFORCE, self-critical), the seams and extensions beyond the
paper (``seams.py``, ``extensions/``) and its evaluation. The LightningModule is ``vision_attn.tasks.CaptionerTask``."""
