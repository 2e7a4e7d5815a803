"""A small VGG-shaped CNN, the teacher of the ViT's distillation (DeiT, Touvron et al. 2021: a convnet's locality
is what a ViT lacks on little data): h = AvgPool(Stage_S(… Pool(Stage_1(x)))), y = W h + b, each stage two 3×3
conv-BN-ReLU layers."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


class ConvNet(nn.Module):
    """Image (B, C, H, W) -> logits (B, classes). ``widths`` are the channels of each stage."""

    def __init__(self, *, in_chans: int = 1, num_classes: int = 10, widths: Sequence[int] = (32, 64, 128),
                 drop_rate: float = 0.0) -> None:
        super().__init__()
        if not widths or any(width < 1 for width in widths):
            raise ValueError(f"widths must be one or more positive channel counts, got {list(widths)}")
        layers: list[nn.Module] = []
        channels = in_chans
        for index, width in enumerate(widths):
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                           nn.ReLU(inplace=True)]
                channels = width
            if index < len(widths) - 1:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(channels, num_classes)
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        """y = W h + b: images (B, C, H, W) -> logits (B, classes)."""
        return self.head(self.head_drop(self.pool(self.features(x)).flatten(1)))
