"""LightningDataModules: Fashion-MNIST, CIFAR-10, ImageFolder (classification); COCO captions and Fashion scenes."""

from vision_attn.datamodules.cifar10_datamodule import CIFAR10DataModule
from vision_attn.datamodules.coco_captions_datamodule import CocoCaptionsDataModule
from vision_attn.datamodules.fashion_mnist_canvas_datamodule import FashionMNISTCanvasDataModule
from vision_attn.datamodules.fashion_mnist_datamodule import FashionMNISTDataModule
from vision_attn.datamodules.fashion_scene_items_datamodule import FashionSceneItemsDataModule
from vision_attn.datamodules.image_folder_datamodule import ImageFolderDataModule

__all__ = ["CIFAR10DataModule", "CocoCaptionsDataModule", "FashionMNISTCanvasDataModule", "FashionMNISTDataModule",
           "FashionSceneItemsDataModule", "ImageFolderDataModule"]
