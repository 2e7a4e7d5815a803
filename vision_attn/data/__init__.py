"""Data without Lightning: image decoding, the vocabulary, dataset files, the Fashion scenes generator and the
torch Datasets built on them (the LightningDataModules live in ``vision_attn.datamodules``)."""
