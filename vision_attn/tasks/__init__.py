"""The LightningModules ("tasks", as torchgeo calls them): each trains one network and knows Lightning; the networks
do not. ``CaptionerTask``, ``EncoderPretrainingTask`` (the captioner's encoder as a classifier first), ``ViTTask`` and
``ConvNetTask``."""

from vision_attn.tasks.captioner_task import CaptionerTask
from vision_attn.tasks.classifiers import ConvNetTask, ViTTask
from vision_attn.tasks.encoder_pretraining import EncoderPretrainingTask

__all__ = ["CaptionerTask", "ConvNetTask", "EncoderPretrainingTask", "ViTTask"]
