"""DeiT's distillation for the ViT: a CNN teacher trained through the CLI, the hard and soft losses computed by
hand, and teachers that cannot teach this student refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO, run_in_process, shipped, tiny
from vision_attn.cli import main
from vision_attn.errors import CheckpointError
from vision_attn.tasks import ViTTask
from vision_attn.vit.convnet import ConvNet

TEACHER_CONFIG = ("trainer/cpu.yaml", "tasks/classifier.yaml", "data/fashion_mnist.yaml",
                  "vit/fashion_mnist_teacher.yaml")
IMAGE = {"size": 28, "channels": 1, "mean": [0.2860], "std": [0.3530]}


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory):
    """configs/vit/fashion_mnist_teacher.yaml for 4 steps through the in-process CLI."""
    run_dir = tmp_path_factory.mktemp("teacher")
    main(["fit", *shipped(*TEACHER_CONFIG), "--trainer.max_time", "null",
          "--trainer.limit_train_batches", "4", "--trainer.max_epochs", "1",
          "--trainer.limit_val_batches", "2", "--trainer.logger", "false", "--trainer.default_root_dir", str(run_dir),
          "--trainer.callbacks.init_args.dirpath", str(run_dir / "ckpt"), "--trainer.enable_progress_bar", "false"])
    return run_dir / "ckpt" / "best.ckpt"


def student(teacher, dist_token: bool = False, **distillation) -> ViTTask:
    module = ViTTask(image=IMAGE, architecture={"patch_size": 7, "embed_dim": 32, "depth": 1, "num_heads": 2,
                                                "dist_token": dist_token},
                     distillation={"teacher": str(teacher), **distillation}, training={"label_smoothing": 0.1},
                     log_overlays=0)
    module.setup("fit")
    return module


def test_convnet_is_the_paper_shaped_cnn_and_refuses_no_stages() -> None:
    net = ConvNet(in_chans=1, num_classes=10, widths=(8, 16))
    assert net(torch.randn(3, 1, 28, 28)).shape == (3, 10)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == \
        [(1, 8, (3, 3)), (8, 8, (3, 3)), (8, 16, (3, 3)), (16, 16, (3, 3))]
    with pytest.raises(ValueError, match="widths"):
        ConvNet(widths=())


@pytest.mark.parametrize("distillation", ["hard", "soft"])
def test_distillation_losses_are_deits(teacher_checkpoint, distillation) -> None:
    torch.manual_seed(0)
    module = student(teacher_checkpoint, dist_token=True, mode=distillation, weight=0.3, tau=2.0).train()
    teacher = module._teacher[0]
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    assert not any(key.startswith("_teacher") or "teacher" in key for key in module.state_dict())
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.manual_seed(1)
    loss, logits = module.classification_loss(images, labels)
    torch.manual_seed(1)
    cls, dist = module.model(images)  # distilled training: both heads
    z_t = teacher(images)
    if distillation == "hard":  # ½-½ in DeiT; here λ = 0.3, the teacher's argmax as a label, smoothed as y is
        teacher_term = F.cross_entropy(dist, z_t.argmax(-1), label_smoothing=0.1)
    else:  # λ τ² KL(ψ(Z_t/τ) ‖ ψ(Z_d/τ))
        p_t = (z_t / 2).softmax(-1)
        teacher_term = 4 * (p_t * (p_t.log() - (dist / 2).log_softmax(-1))).sum(-1).mean()
    expected = 0.7 * F.cross_entropy(cls, labels, label_smoothing=0.1) + 0.3 * teacher_term
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(logits, (cls + dist) / 2)
    module.eval()
    with torch.no_grad():
        assert torch.allclose(module(images), (cls + dist) / 2, atol=1e-6)  # the heads' mean classifies


def test_a_teacher_for_other_images_or_of_another_kind_is_refused(teacher_checkpoint, tmp_path) -> None:
    with pytest.raises(CheckpointError, match="teacher's image size is 28, the student's 56"):
        ViTTask(image={**IMAGE, "size": 56}, architecture={"patch_size": 7, "embed_dim": 32, "depth": 1,
                                                           "num_heads": 2},
                distillation={"teacher": str(teacher_checkpoint)}).setup("fit")
    captioner = tmp_path / "captioner.ckpt"
    torch.save({"vision_attn_kind": "captioner", "state_dict": {}, "hyper_parameters": {}}, captioner)
    with pytest.raises(CheckpointError, match="a teacher is a CNN classifier"):
        student(captioner)


def test_the_default_trains_with_a_teacher_through_the_cli(teacher_checkpoint, tmp_path) -> None:
    """The teacher config's checkpoint under the ViT default's config, two steps; the student's checkpoint
    holds no teacher and classifies alone."""
    result = run_in_process("fit", *tiny("vit_tiny.yaml"), "--trainer.default_root_dir",
                            str(tmp_path), "--model.init_args.distillation.teacher", str(teacher_checkpoint),
                            "--model.init_args.architecture.dist_token", "true", "--trainer.limit_train_batches", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    state = torch.load(checkpoint, weights_only=True)["state_dict"]
    assert "model.head_dist.weight" in state and not any("teacher" in key for key in state)
    result = run_in_process("classify", "--ckpt", str(checkpoint), str(REPO / "docs" / "overlay_vit.png"),
                            "--out", str(tmp_path / "classes.json"))
    assert result.returncode == 0, result.stderr[-2000:]
