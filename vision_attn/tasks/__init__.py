"""The LightningModules ("tasks", as torchgeo calls them): each trains one network, and knows Lightning; the
networks (``captioning/``, ``vit/``) do not. Configs pick a task by class path, e.g.
``vision_attn.tasks.CaptionerTask``.

- ``CaptionerTask``: Show, Attend and Tell (``captioner_task.py``);
- ``EncoderPretrainingTask``: the captioner's encoder as a classifier first (``encoder_pretraining.py``);
- ``ViTTask`` and ``ConvNetTask``: the image classifiers (``classifiers.py``).
"""

from vision_attn.tasks.captioner_task import CaptionerTask
from vision_attn.tasks.classifiers import ConvNetTask, ViTTask
from vision_attn.tasks.encoder_pretraining import EncoderPretrainingTask

__all__ = ["CaptionerTask", "ConvNetTask", "EncoderPretrainingTask", "ViTTask"]
