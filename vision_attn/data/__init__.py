"""LightningDataModules: Fashion-MNIST, CIFAR-10, ImageFolder (classification); COCO captions and Fashion scenes."""

from vision_attn.data.cifar10 import CIFAR10DataModule
from vision_attn.data.coco import CocoCaptionsDataModule
from vision_attn.data.fashion_mnist import FashionMNISTDataModule
from vision_attn.data.imagefolder import ImageFolderDataModule

__all__ = ["CIFAR10DataModule", "CocoCaptionsDataModule", "FashionMNISTDataModule", "ImageFolderDataModule"]
