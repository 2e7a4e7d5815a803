"""Where a Fashion scenes captioner loses recognition: each object's class read from the annotation vectors under
its box, by the pretrained encoder's own head, by linear probes on the pretrained and the captioner's trunks, and
by the captioner's object head (when it was trained with ``object_weight``).

    python scripts/probe_recognition.py runs/encoder_fashion_scene_items/checkpoints/best.ckpt \
        runs/captioner_fashion_scenes/checkpoints/best.ckpt data/fashion_scenes_mixed_bright

Each box's feature is the mean of the grid's annotation vectors weighted by how much of each cell the box covers.
The probes are multinomial logistic regressions fitted (L-BFGS, a little L2) on the val scenes' boxes and scored
on the test scenes'. Prints overall and per-class accuracy for each reader.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from vision_attn.captioning.encoder import EncoderClassifier
from vision_attn.checkpoint import load_file, upgrade


def load_split(root: Path, split: str, mean: Tensor, std: Tensor) -> tuple[Tensor, list[list[tuple]], list[str]]:
    instances = json.loads((root / "annotations" / f"instances_{split}.json").read_text(encoding="utf-8"))
    names = [c["name"] for c in sorted(instances["categories"], key=lambda c: c["id"])]
    boxes: dict[int, list[tuple]] = {}
    for annotation in instances["annotations"]:
        boxes.setdefault(annotation["image_id"], []).append((annotation["bbox"], annotation["category_id"] - 1))
    images = sorted(instances["images"], key=lambda image: image["id"])
    pixels = [np.array(Image.open(root / "images" / split / image["file_name"]).convert("RGB")) for image in images]
    batch = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 255
    return (batch - mean) / std, [boxes.get(image["id"], []) for image in images], names


def box_weights(box: list[float], grid: int, size: int) -> Tensor:
    """(grid, grid) weights: the share of the box's area in each cell."""
    x, y, w, h = box
    edges = torch.arange(grid + 1, dtype=torch.float32) * size / grid
    lower, upper = edges[:-1], edges[1:]
    overlap_x = (upper.clamp(max=x + w) - lower.clamp(min=x)).clamp(min=0)
    overlap_y = (upper.clamp(max=y + h) - lower.clamp(min=y)).clamp(min=0)
    weights = overlap_y[:, None] * overlap_x[None, :]
    return weights / weights.sum()


@torch.no_grad()
def box_features(trunk: torch.nn.Module, images: Tensor, boxes: list[list[tuple]]) -> tuple[Tensor, Tensor]:
    features, labels = [], []
    for start in range(0, len(images), 100):
        maps = trunk(images[start:start + 100])  # (B, D, G, G)
        for offset, feature_map in enumerate(maps):
            for box, label in boxes[start + offset]:
                weights = box_weights(box, feature_map.shape[-1], images.shape[-1])
                features.append((feature_map * weights).sum((1, 2)))
                labels.append(label)
    return torch.stack(features), torch.tensor(labels)


def linear_probe(train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], classes: int) -> Tensor:
    (x_train, y_train), (x_test, _) = train, test
    mean, std = x_train.mean(0), x_train.std(0) + 1e-5
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    probe = torch.nn.Linear(x_train.shape[1], classes)
    optimizer = torch.optim.LBFGS(probe.parameters(), max_iter=300)

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(probe(x_train), y_train) + 1e-3 * probe.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return probe(x_test).argmax(1)


def report(label: str, predicted: Tensor, truth: Tensor, names: list[str]) -> None:
    per_class = " ".join(f"{name}={(predicted[truth == c] == c).float().mean():.2f}" for c, name in enumerate(names))
    print(f"{label}: {(predicted == truth).float().mean():.3f}  ({per_class})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("encoder", help="an encoder pretraining checkpoint (fashion_scene_items.yaml's)")
    parser.add_argument("captioner", help="a captioner checkpoint that started from it")
    parser.add_argument("scenes", type=Path, help="a Fashion scenes root with val and test splits")
    options = parser.parse_args()
    pretrained = upgrade(load_file(options.encoder))  # checkpoints of any version, in today's groups
    hyper = pretrained["hyper_parameters"]
    mean, std = (torch.tensor(hyper["image"][key]).view(3, 1, 1) for key in ("mean", "std"))
    encoder = {key: hyper["encoder"][key] for key in ("backbone", "width", "stride")}
    classifier = EncoderClassifier(encoder, num_classes=hyper["num_classes"], num_colours=len(hyper["colour_names"]))
    classifier.load_state_dict({k.removeprefix("model."): v for k, v in pretrained["state_dict"].items()})
    captioner_trunk = EncoderClassifier(encoder).encoder.trunk
    state = upgrade(load_file(options.captioner))["state_dict"]
    captioner_trunk.load_state_dict({k.split("encoder.trunk.", 1)[1]: v for k, v in state.items()
                                     if "encoder.trunk." in k})
    classifier.eval(), captioner_trunk.eval()
    val_images, val_boxes, names = load_split(options.scenes, "val", mean, std)
    test_images, test_boxes, _ = load_split(options.scenes, "test", mean, std)

    test = box_features(classifier.encoder.trunk, test_images, test_boxes)
    with torch.no_grad():
        report("pretrained encoder, its own head", classifier.head(test[0]).argmax(1), test[1], names)
    val = box_features(classifier.encoder.trunk, val_images, val_boxes)
    report("pretrained trunk, linear probe", linear_probe(val, test, len(names)), test[1], names)
    val = box_features(captioner_trunk, val_images, val_boxes)
    test = box_features(captioner_trunk, test_images, test_boxes)
    report("captioner's trunk, linear probe", linear_probe(val, test, len(names)), test[1], names)
    if "auxiliary.object.head.weight" in state:  # the captioner's object loss head (objective.auxiliary), as trained
        head = torch.nn.Linear(*state["auxiliary.object.head.weight"].shape[::-1])
        head.load_state_dict({"weight": state["auxiliary.object.head.weight"],
                              "bias": state["auxiliary.object.head.bias"]})
        with torch.no_grad():
            report("captioner's trunk, its object head", head(test[0]).argmax(1), test[1], names)


if __name__ == "__main__":
    main()
