"""LightningDataModules: Fashion-MNIST, CIFAR-10, ImageFolder (classification); COCO captions and Fashion scenes.

Configs pick them by class path, e.g. ``vision_attn.datamodules.FashionMNISTDataModule``.
"""

from vision_attn.datamodules.captions import CocoCaptionsDataModule
from vision_attn.datamodules.classification import (
    CIFAR10DataModule,
    FashionMNISTCanvasDataModule,
    FashionMNISTDataModule,
    FashionSceneItemsDataModule,
    ImageFolderDataModule,
)

__all__ = ["CIFAR10DataModule", "CocoCaptionsDataModule", "FashionMNISTCanvasDataModule", "FashionMNISTDataModule",
           "FashionSceneItemsDataModule", "ImageFolderDataModule"]
