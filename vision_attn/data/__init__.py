"""Data without Lightning: image decoding, the vocabulary, dataset files (Fashion-MNIST, CIFAR-10, COCO,
Karpathy), the Fashion scenes generator, and the torch Datasets built on them. The LightningDataModules
live in ``vision_attn.datamodules``."""
