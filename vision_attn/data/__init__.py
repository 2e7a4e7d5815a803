"""LightningDataModules: Fashion-MNIST, CIFAR-10, ImageFolder (classification)."""

from vision_attn.data.cifar10 import CIFAR10DataModule
from vision_attn.data.fashion_mnist import FashionMNISTDataModule
from vision_attn.data.imagefolder import ImageFolderDataModule

__all__ = ["CIFAR10DataModule", "FashionMNISTDataModule", "ImageFolderDataModule"]
