"""LightningModules for the image classifiers: the ViT, and the small CNN that can teach it (DeiT's distillation):
the loss, accuracy, the optimiser and its schedule.

The checkpoint kind, the non-finite guard, warm-up + cosine and the overlay logging live in ``task.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
import torchmetrics
from PIL import Image
from torch import Tensor

from vision_attn.boxes import box_cell_coverage
from vision_attn.checkpoint import (
    CONVNET,
    KIND_NAMES,
    VIT,
    checkpoint_kind,
    constructor_args,
    load_file,
    read_model_checkpoint,
)
from vision_attn.errors import CheckpointError
from vision_attn.schedule import decay_groups
from vision_attn.task import BaseTask
from vision_attn.vit.convnet import ConvNet
from vision_attn.vit.inference import Classifier, map_scores, validation_figures, vit_from_hparams
from vision_attn.vit.pretrained import load_pretrained
from vision_attn.vit.rollout import attention_rollout, explain, pooled_weights

log = logging.getLogger(__name__)

MAP_SCORES = ("rollout_mass", "rollout_pointing", "last_layer_mass", "last_layer_pointing")
TEACHER_KINDS = (CONVNET, VIT)


class ClassifierTask(BaseTask):
    """What the image classifiers share: top-1 accuracy (micro) and the mean loss in training, validation and
    test, softmax predictions, AdamW (no decay on norms, biases and the model's ``no_weight_decay``) with
    warm-up + cosine. Subclasses build ``self.model`` (images -> logits) and may override ``training_logits``."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        # top-1 accuracy over images (micro): torchmetrics' default would average the per-class recalls
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.test_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        # the mean loss over images, summed and counted across DDP ranks (a mean of rank means would weigh
        # ranks with fewer images too much)
        self.val_loss = torchmetrics.MeanMetric()
        self.test_loss = torchmetrics.MeanMetric()

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def classification_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None = None,
                            origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(loss, logits) of a training batch: cross-entropy with label smoothing. ``boxes`` (B, 4) [x, y, w, h]
        in pixels are the objects' places when the DataModule knows them, and ``origins`` (B, 2) where each image
        lies in a larger one when it is a window of it (``FashionMNISTCanvasDataModule``); a convnet reads a
        window as any image."""
        logits = self.model(images)
        return F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing), logits

    def training_loss(self, batch: tuple[Tensor, ...]) -> Tensor:
        images, labels, *places = batch
        loss, logits = self.classification_loss(images, labels, *places)
        self.train_accuracy(logits, labels)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def evaluation_logits(self, images: Tensor, masks: list[Tensor], stage: str) -> Tensor:
        return self.model(images)

    def _evaluate(self, batch: tuple[Tensor, ...] | None, stage: str, accuracy: torchmetrics.Metric,
                  mean_loss: torchmetrics.Metric) -> None:
        if batch is None:
            return
        images, labels, *masks = batch
        logits = self.evaluation_logits(images, masks, stage)
        accuracy(logits, labels)
        mean_loss(F.cross_entropy(logits, labels, reduction="none"))
        self.log(f"{stage}/loss", mean_loss)
        self.log(f"{stage}/acc", accuracy, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, ...] | None, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy, self.val_loss)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy, self.test_loss)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0]).softmax(dim=-1)

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        skip = self.model.no_weight_decay() if hasattr(self.model, "no_weight_decay") else set()
        groups = decay_groups(self.model, self.hparams.weight_decay, skip=skip)
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas)
        return self.warmup_cosine(optimizer, warmup_epochs=self.hparams.warmup_epochs,
                                  min_lr_ratio=self.hparams.min_lr_ratio, by_time=self.hparams.schedule_by_time)


class ConvNetClassifier(ClassifierTask):
    """Trains the small CNN of ``vit/convnet.py``, the ViT's teacher for DeiT's distillation (``ViTClassifier``'s
    ``teacher``), with the ViT's optimiser, schedule, label smoothing and data links."""

    kind = CONVNET

    def __init__(
        self,
        *,
        num_classes: int = 10,
        image_size: int = 28,
        in_chans: int = 1,
        widths: list[int] = (32, 64, 128),
        drop_rate: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        schedule_by_time: bool = False,
        label_smoothing: float = 0.0,
        log_overlays: int = 0,
        class_names: list[str] | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.model = ConvNet(**constructor_args(ConvNet, self.hparams))

    def overlay_figures(self, batch: tuple[Tensor, Tensor], outputs: None, count: int) -> list[tuple[str, Image.Image]]:
        return []  # a CNN has no attention to draw


class ViTClassifier(ClassifierTask):
    """Trains ``VisionTransformer`` with AdamW, warm-up + cosine, label smoothing; logs top-1 accuracy.

    ``num_classes``, ``in_chans``, ``image_size``, ``class_names``, ``mean`` and ``std`` are linked from the
    DataModule by the CLI, and stored with the checkpoint, so ``classify`` can preprocess new images alone.
    When the evaluation batches carry object masks, ``(images, labels, masks)`` as
    ``FashionMNISTCanvasDataModule``'s do, validation and test also log where rollout and the last layer's
    attention (its heads' mean) fall: ``{stage}/rollout_mass``, ``{stage}/rollout_pointing``,
    ``{stage}/last_layer_mass`` and ``{stage}/last_layer_pointing`` (SPEC §5; ``metrics.pointing_game``).
    After each validation epoch (not the sanity check), rank 0 logs rollout overlays of the first
    ``log_overlays`` validation images (0: none). With ``schedule_by_time`` and a ``trainer.max_time``, the
    cosine decay runs over the time budget as well as the steps (whichever is further along), so a run capped
    by time always finishes its schedule; ``max_epochs`` is then an upper bound. ``pretrained`` is a local
    weights file or ``timm:<model name>[.<tag>]`` (timm's weights from the Hugging Face cache), adapted to this
    ViT (``vit/pretrained.py``). ``patch_drop_rate_end`` schedules PatchDropout: the rate goes linearly from
    ``patch_drop_rate`` at the first step to ``patch_drop_rate_end`` at the end of training (of the ``max_time``
    budget with ``schedule_by_time``, else of the run's steps), so early steps, when the model learns coarse
    shapes, are cheap and the last ones see more of each image.

    ``teacher`` distils a trained classifier into the ViT (Touvron et al. 2021, DeiT): a ``vision-attn fit``
    checkpoint of a ``ConvNetClassifier`` (DeiT's choice: a convnet passes on its inductive bias) or of another
    ViT, trained on the same data and normalisation. It is frozen, runs on every training batch, and is not
    saved with the student. With ``dist_token`` the distillation token's head learns the teacher and the cls
    head the labels, and the two heads' mean classifies; without it, the one head learns both. ``distillation:
    hard`` (DeiT's best) takes the teacher's argmax as a label: L = (1 − λ) CE(ψ(Z_s), y) + λ CE(ψ(Z_d), y_t)
    with λ = ``distillation_weight`` (DeiT: ½); ``soft`` matches its softened distribution instead:
    λ τ² KL(ψ(Z_t / τ) ‖ ψ(Z_d / τ)), τ = ``distillation_tau``.
    """

    kind = VIT

    def __init__(
        self,
        *,
        num_classes: int = 10,
        image_size: int = 28,
        in_chans: int = 1,
        patch_size: int = 4,
        embed_dim: int = 64,
        depth: int = 6,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        patch_drop_rate: float = 0.0,
        patch_drop_rate_end: float | None = None,
        global_pool: Literal["token", "avg"] = "token",
        pos_embed_init: Literal["trunc_normal", "sincos"] = "trunc_normal",
        zero_init_head: bool = False,
        fused_attention: bool = True,
        stem: Literal["patch", "conv"] = "patch",
        reg_tokens: int = 0,
        dist_token: bool = False,
        channels_last: bool = False,
        attention_grounding: float = 0.0,
        teacher: str | None = None,
        distillation: Literal["hard", "soft"] = "hard",
        distillation_weight: float = 0.5,
        distillation_tau: float = 1.0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.0,
        schedule_by_time: bool = False,
        label_smoothing: float = 0.0,
        pretrained: str | None = None,
        compile: bool = False,
        log_overlays: int = 4,
        class_names: list[str] | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        if patch_drop_rate_end is not None and not 0.0 <= patch_drop_rate_end < 1.0:
            raise ValueError(f"patch_drop_rate_end must be in [0, 1), got {patch_drop_rate_end}")
        if not 0.0 <= distillation_weight <= 1.0 or distillation_tau <= 0:
            raise ValueError(f"distillation_weight must be in [0, 1] and distillation_tau above 0, got "
                             f"{distillation_weight} and {distillation_tau}")
        if dist_token and not teacher:
            log.info("dist_token without a teacher: the distillation head learns the labels too")
        if attention_grounding < 0 or (attention_grounding and teacher):
            raise ValueError(f"attention_grounding must be 0 or more, and is not combined with a teacher: got "
                             f"{attention_grounding}{' with teacher ' + teacher if teacher else ''}")
        self._progress: Callable[[], float] | None = None  # the share of training done, for the PatchDropout schedule
        self._teacher: list[torch.nn.Module] = []  # a list: the teacher is not a submodule, so not in checkpoints
        self.model = vit_from_hparams(self.hparams)
        if pretrained:
            fresh = load_pretrained(self.model, pretrained)
            log.info("loaded %s (fresh: %s)", pretrained, ", ".join(fresh) or "nothing")
        # where the maps fall, when the evaluation batches carry object masks (FashionMNISTCanvasDataModule)
        self.map_scores = torch.nn.ModuleDict({f"{stage}_{name}": torchmetrics.MeanMetric() for stage in ("val", "test")
                                               for name in MAP_SCORES})
        if compile:
            self.model.compile()  # in place: parameter names and checkpoints stay the same

    def setup(self, stage: str) -> None:
        if stage == "fit" and self.hparams.teacher and not self._teacher:
            self._teacher.append(load_teacher(self.hparams.teacher, self.hparams))
            self.model.distilled_training = self.hparams.dist_token

    def on_train_start(self) -> None:
        for teacher in self._teacher:
            teacher.to(self.device)
        if self.hparams.patch_drop_rate_end is None:
            return
        by_time = self._time_budget_used() if self.hparams.schedule_by_time else None
        total = max(1, int(self.trainer.estimated_stepping_batches))
        self._progress = by_time or (lambda: self.global_step / total)

    def classification_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None = None,
                            origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self._progress is not None:  # p = p_0 + (p_end − p_0) · (share of training done)
            start, end = self.hparams.patch_drop_rate, self.hparams.patch_drop_rate_end
            self.model.patch_drop_rate = start + (end - start) * min(1.0, self._progress())
            self.log("train/patch_drop_rate", self.model.patch_drop_rate, on_step=False, on_epoch=True)
        if self.hparams.attention_grounding:
            return self.grounded_loss(images, labels, boxes, origins)
        if origins is not None and self._teacher:
            raise ValueError("a teacher reads whole images: train without windows (train_window) to distil")
        if not self._teacher:
            logits = self.model.forward_head(self.model.forward_features(images, window_origin=origins))
            return F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing), logits
        with torch.no_grad():
            teacher_logits = self._teacher[0](images).float()
        output = self.model(images)
        logits, distilled = output if isinstance(output, tuple) else (output, output)
        smoothing, weight = self.hparams.label_smoothing, self.hparams.distillation_weight
        if self.hparams.distillation == "hard":  # y_t = argmax_c Z_t(c)
            teacher_loss = F.cross_entropy(distilled, teacher_logits.argmax(dim=-1), label_smoothing=smoothing)
        else:
            tau = self.hparams.distillation_tau
            teacher_loss = tau ** 2 * F.kl_div(F.log_softmax(distilled / tau, dim=-1),
                                               F.log_softmax(teacher_logits / tau, dim=-1), reduction="batchmean",
                                               log_target=True)
        loss = (1 - weight) * F.cross_entropy(logits, labels, label_smoothing=smoothing) + weight * teacher_loss
        self.log("train/teacher_loss", teacher_loss)
        return loss, (logits + distilled) / 2

    def grounded_loss(self, images: Tensor, labels: Tensor, boxes: Tensor | None,
                      origins: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Cross-entropy plus ``attention_grounding`` × −log(the share of the rollout on the object's box): the
        classifier's attention rollout (mean over heads, as ``vision-attn rollout-mass`` scores it) is pulled onto
        the training object, each patch counting by how much of it the box covers. As the captioner's grounding
        trains its α on the training boxes; the maps are then scored on test objects it never saw."""
        if boxes is None:
            raise ValueError("attention_grounding needs training batches that carry the objects' boxes, as "
                             "FashionMNISTCanvasDataModule's do")
        tokens, attentions, kept = self.model.forward_features(images, return_attention=True, return_kept=True,
                                                               window_origin=origins)
        logits = self.model.forward_head(tokens)
        height, width = images.shape[-2:]
        corners = torch.cat([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], dim=1).to(images.dtype)  # x0 y0 x1 y1
        corners = corners / corners.new_tensor([width, height, width, height])
        patch = self.model.patch_embed.patch_size
        coverage = box_cell_coverage(corners, (height // patch, width // patch))  # (B, N): each patch's share in it
        if kept is not None:
            coverage = coverage.gather(1, kept)  # the patches PatchDropout kept, (B, K)
        weights = pooled_weights(attention_rollout(attentions), self.model.global_pool,
                                 self.model.num_prefix_tokens)  # (B, K)
        share = (weights * coverage).sum(-1) / weights.sum(-1).clamp_min(1e-12)
        grounding = -share.clamp_min(1e-6).log().mean()
        self.log("train/grounding", grounding)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        return loss + self.hparams.attention_grounding * grounding, logits

    def evaluation_logits(self, images: Tensor, masks: list[Tensor], stage: str) -> Tensor:
        if not masks:
            return self.model(images)
        # items with masks: also score where rollout and the last layer's attention fall (SPEC §5)
        maps = explain(self.model, images)
        for name, (mass, hits) in map_scores(maps, masks[0]).items():  # rollout and the last layer
            key = f"{stage}_{name.replace(' ', '_')}"
            self.map_scores[f"{key}_mass"](mass)
            self.map_scores[f"{key}_pointing"](hits.float())
        for name in MAP_SCORES:
            self.log(f"{stage}/{name}", self.map_scores[f"{stage}_{name}"])
        return maps.logits

    def overlay_figures(self, batch: tuple[Tensor, Tensor], outputs: None, count: int) -> list[tuple[str, Image.Image]]:
        classifier = Classifier.from_hparams(self.model, self.hparams)
        return validation_figures(classifier, batch[0][:count].detach(), batch[1][:count].detach())


def load_teacher(path: str, student: dict) -> torch.nn.Module:
    """The frozen classifier of a ``vision-attn fit`` checkpoint (a ConvNetClassifier's or a ViTClassifier's), in
    eval mode; refused in one line when it does not read the student's images (classes, size, channels,
    normalisation)."""
    loaded = load_file(path)
    kind = checkpoint_kind(loaded)
    if kind not in TEACHER_KINDS:
        raise CheckpointError(f"{path}: a teacher is a {KIND_NAMES[CONVNET]} or {KIND_NAMES[VIT]} checkpoint, "
                              f"not {KIND_NAMES.get(kind, 'an unmarked one') if kind else 'an unmarked one'}")
    saved = read_model_checkpoint(path, kind=kind, loaded=loaded)
    for name in ("num_classes", "image_size", "in_chans", "mean", "std"):
        theirs, ours = saved.hparams.get(name), student.get(name)
        if theirs is not None and ours is not None and list(torch.tensor(theirs).flatten().tolist()) != \
                list(torch.tensor(ours).flatten().tolist()):
            raise CheckpointError(f"{path}: the teacher's {name} is {theirs}, the student's {ours}: it must be "
                                  "trained on the same images")
    model = ConvNet(**constructor_args(ConvNet, saved.hparams)) if kind == CONVNET else vit_from_hparams(saved.hparams)
    model.load_state_dict(saved.state_dict)
    log.info("distilling from %s (%s)", path, KIND_NAMES[kind])
    return model.eval().requires_grad_(False)
