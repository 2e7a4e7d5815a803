"""LightningModule for the Show-Attend-Tell captioner: losses, decoding, COCO metrics, results JSON."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor

from vision_attn.captioning.beam_search import Hypothesis, beam_search, sample_captions
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.encoder import AnnotationEncoder
from vision_attn.captioning.losses import (
    caption_nll,
    doubly_stochastic_penalty,
    reinforce_surrogate,
    self_critical_loss,
)
from vision_attn.captioning.vocabulary import END_ID, PAD_ID, START_ID, Vocabulary, tokenize
from vision_attn.checkpoint import (
    KIND_KEY,
    RNG_KEY,
    CheckpointError,
    capture_rng_state,
    require_kind,
    restore_rng_state,
)
from vision_attn.data.base import report_skipped_images
from vision_attn.data.imagefolder import IMAGENET_MEAN, IMAGENET_STD
from vision_attn.data.images import denormalize, to_pil
from vision_attn.io import write_json_atomically
from vision_attn.metrics import CiderD, caption_scores, deduplicate, pointing_scores
from vision_attn.overlay import caption_overlay, log_figures
from vision_attn.schedule import warmup_cosine

log = logging.getLogger(__name__)


def _adjacent_equal_groups(caption_images: Tensor, images: int) -> bool:
    """Whether captions come as r adjacent rows per image for every image (0,0,1,1,2,2...): the decoder
    then shares each image's annotations among its captions instead of copying them."""
    if len(caption_images) % images:
        return False
    expected = torch.arange(images, device=caption_images.device).repeat_interleave(len(caption_images) // images)
    return bool(torch.equal(caption_images, expected))


def _word_ids(caption: list[int]) -> list[int]:
    """The word ids of an encoded caption, without <start>, <end> and <pad>."""
    return [word for word in caption if word not in (START_ID, END_ID, PAD_ID)]


class ShowAttendTell(L.LightningModule):
    """Trains encoder + attention decoder with teacher forcing; decodes with beam search in val/test.

    From epoch ``self_critical_from_epoch`` (default never) training is self-critical instead (Rennie et al.
    2017): ``self_critical_samples`` captions are drawn per image from the decoder, each is rewarded by its
    CIDEr-D against the image's references, and REINFORCE raises the ones that beat their siblings' mean. The
    model then picks its own order of naming objects, which the likelihood of order-free references does not
    let it do (see the README's Results). It needs grouped captions (``group_captions: true``).

    ``vocabulary`` (the DataModule's tokens, linked by the CLI), ``image_size``, ``mean`` and ``std`` are
    stored with the checkpoint as plain lists, so ``caption`` needs nothing else. ``test`` writes the SPEC §4
    results JSON to ``<log dir>/results_test.json`` (the run's ``default_root_dir`` without a logger).
    """

    def __init__(
        self,
        *,
        vocabulary: list[str] | None = None,
        backbone: str = "small",
        encoder_width: int = 32,
        encoder_stride: int = 16,
        grid_size: int | None = None,
        pretrained_encoder: str | None = None,
        trainable_stages: int = -1,
        embed_dim: int = 512,
        hidden_dim: int = 512,
        attention_dim: int = 512,
        dropout: float = 0.5,
        attention: Literal["soft", "hard"] = "soft",
        initial_gate: float = 0.5,
        doubly_stochastic_weight: float = 0.0,
        hard_expectation_prob: float = 0.5,
        reinforce_weight: float = 1.0,
        entropy_weight: float = 0.01,
        baseline_decay: float = 0.9,
        self_critical_from_epoch: int | None = None,
        self_critical_samples: int = 5,
        lr: float = 4e-4,
        encoder_lr: float | None = None,
        weight_decay: float = 0.0,
        warmup_epochs: float = 0.0,
        beam_size: int = 3,
        max_decode_length: int = 20,
        length_penalty: float = 0.0,
        image_size: int = 224,
        mean: list[float] | None = None,
        std: list[float] | None = None,
        log_overlays: int = 4,
    ) -> None:
        super().__init__()
        if not vocabulary:
            raise ValueError("vocabulary is empty: link it from the DataModule (the CLI does) or pass the tokens")
        if self_critical_from_epoch is not None:
            if self_critical_from_epoch < 0:
                raise ValueError(f"self_critical_from_epoch must be an epoch number (0 or more), got "
                                 f"{self_critical_from_epoch}")
            if self_critical_samples < 2:
                raise ValueError(f"self_critical_samples must be at least 2 (the baseline is the mean reward of "
                                 f"an image's other samples), got {self_critical_samples}")
            if attention == "hard":
                raise ValueError("self-critical training is for soft attention; hard attention trains its "
                                 "locations with its own REINFORCE (set self_critical_from_epoch: null)")
        self.save_hyperparameters()
        self.vocab = Vocabulary(vocabulary)
        self.encoder = AnnotationEncoder(backbone=backbone, width=encoder_width, grid_size=grid_size,
                                         pretrained=pretrained_encoder, trainable_stages=trainable_stages,
                                         small_stride=encoder_stride)
        self.decoder = AttentionDecoder(
            vocab_size=len(self.vocab), annotation_dim=self.encoder.annotation_dim, embed_dim=embed_dim,
            hidden_dim=hidden_dim, attention_dim=attention_dim, dropout=dropout, attention=attention,
            hard_expectation_prob=hard_expectation_prob, initial_gate=initial_gate,
        )
        self.register_buffer("reward_baseline", torch.zeros(()))  # b, the moving average of log p(y | s, a)
        self._cider: CiderD | None = None  # the self-critical reward, built from the training references
        self._outputs: list[dict[str, Any]] = []
        self._overlay_examples: list[tuple[Tensor, dict[str, Any]]] = []

    def forward(self, images: Tensor, captions: Tensor, caption_images: Tensor | None = None):  # noqa: ANN201
        """Teacher-forced DecoderOutput; caption n is of image ``caption_images[n]`` (default: of image n)."""
        annotations, _ = self.encoder(images)  # each image encoded once, however many captions it has
        if caption_images is not None and not _adjacent_equal_groups(caption_images, len(images)):
            annotations = annotations[caption_images]  # uneven groups: a copy per caption, (B, L, D) -> (N, L, D)
        return self.decoder(annotations, captions)

    # ----------------------------------------------------------------------------------------- training
    def _loss(self, images: Tensor, captions: Tensor, stage: str, caption_images: Tensor | None = None) -> Tensor:
        captions = captions.long()
        output = self(images, captions, caption_images)
        targets = captions[:, 1:]
        mask = (targets != PAD_ID).to(output.logits.dtype)  # (B, T): real tokens, <end> included
        tokens = mask.sum().clamp_min(1)
        nll = caption_nll(output.logits, targets, mask)  # (B,)
        loss = nll.sum() / tokens
        if self.hparams.doubly_stochastic_weight:
            penalty = doubly_stochastic_penalty(output.alphas, mask).mean()
            loss = loss + self.hparams.doubly_stochastic_weight * penalty  # + λ Σ_i (1 − Σ_t α_ti)²
            self.log(f"{stage}/ds_penalty", penalty, batch_size=len(captions))
        if output.location_log_probs is not None:
            sequence_log_likelihood = -nll.detach()
            surrogate = reinforce_surrogate(
                -nll, output.location_log_probs, output.location_entropy, mask,
                baseline=float(self.reward_baseline), reinforce_weight=self.hparams.reinforce_weight,
                entropy_weight=self.hparams.entropy_weight,
            )
            loss = loss - surrogate.sum() / tokens
            decay = self.hparams.baseline_decay  # b ← decay·b + (1 − decay)·log p(y | s, a)
            self.reward_baseline.mul_(decay).add_((1 - decay) * sequence_log_likelihood.mean())
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=len(captions))
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor | None:  # noqa: ANN001 - CaptionBatch
        if batch is None:  # every image of the batch was unreadable (skipped and counted by the DataModule)
            return None
        if self.self_critical:
            loss = self._self_critical_loss(batch)
        else:
            loss = self._loss(batch.images, batch.captions, "train", batch.caption_images)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {self.global_step}; stopping "
                                     "(the checkpoints written so far are intact)")
        return loss

    @property
    def self_critical(self) -> bool:
        """Whether this epoch trains on the model's own samples with the CIDEr-D reward instead of by likelihood."""
        start = self.hparams.self_critical_from_epoch
        return start is not None and self.current_epoch >= start

    def _reward(self) -> CiderD:
        """CIDEr-D with document frequencies from every training image's references (as word ids), built once."""
        if self._cider is None:
            datamodule = getattr(self.trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "records"):
                raise RuntimeError("self-critical training scores samples with CIDEr-D against the training "
                                   "references, and needs a DataModule with records('train') (CocoCaptionsDataModule)")
            limit = self.hparams.max_decode_length
            corpus = [[_word_ids(self.vocab.encode(tokenize(caption), limit)) for caption in record.captions]
                      for record in datamodule.records("train")]
            self._cider = CiderD(corpus)
            log.info("self-critical training from epoch %d: CIDEr-D reward over the references of %d training "
                     "images", self.hparams.self_critical_from_epoch, len(corpus))
        return self._cider

    def _self_critical_loss(self, batch) -> Tensor:  # noqa: ANN001 - CaptionBatch
        """Self-critical sequence training: n captions sampled per image, rewarded by CIDEr-D against the
        image's references in the batch, each compared with the mean reward of its siblings."""
        if batch.caption_images is None:
            raise ValueError("self-critical training needs every reference of an image in its batch: set the "
                             "DataModule's group_captions: true")
        samples_per_image = self.hparams.self_critical_samples
        annotations, _ = self.encoder(batch.images)
        sampled = sample_captions(self.decoder, annotations, per_image=samples_per_image, start_id=START_ID,
                                  end_id=END_ID, pad_id=PAD_ID, max_length=self.hparams.max_decode_length)
        references: list[list[list[int]]] = [[] for _ in range(len(batch.images))]
        for image, caption in zip(batch.caption_images.tolist(), batch.captions.tolist(), strict=True):
            references[image].append(_word_ids(caption))
        candidates = [_word_ids(caption) for caption in sampled.tokens.tolist()]
        rewards = torch.tensor(self._reward()(candidates, [references[n // samples_per_image]
                                                           for n in range(len(candidates))]),
                               dtype=sampled.log_probs.dtype, device=sampled.log_probs.device)
        loss = self_critical_loss(sampled.log_probs, sampled.mask, rewards, samples_per_image).sum()
        loss = loss / sampled.mask.sum().clamp_min(1)
        self.log("train/reward", rewards.mean(), prog_bar=True, batch_size=len(candidates))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(candidates))
        return loss

    # ------------------------------------------------------------------------------------- evaluation
    def encode_references(self, references: list[list[str]]) -> Tensor:
        """The first reference of each image as padded ids (B, T+1), for the teacher-forced eval loss."""
        limit = self.hparams.max_decode_length
        encoded = [self.vocab.encode(tokenize(refs[0]), limit) for refs in references]
        width = max(len(ids) for ids in encoded)
        return torch.tensor([ids + [PAD_ID] * (width - len(ids)) for ids in encoded], device=self.device)

    def decode(self, images: Tensor, *, beam_size: int | None = None) -> tuple[list[Hypothesis], tuple[int, int]]:
        """Best caption per image with its α/β traces, and the annotation grid (Gh, Gw)."""
        annotations, grid = self.encoder(images)
        beams = beam_search(
            self.decoder, annotations, start_id=START_ID, end_id=END_ID, pad_id=PAD_ID,
            beam_size=beam_size or self.hparams.beam_size, max_length=self.hparams.max_decode_length,
            length_penalty=self.hparams.length_penalty,
        )
        return [image_beams[0] for image_beams in beams], grid

    def to_record(self, image_id: Any, hypothesis: Hypothesis, grid: tuple[int, int],
                  image_size: tuple[int, int], file_name: str = "") -> dict[str, Any]:
        """A SPEC §4 record: the COCO result fields plus tokens, grid, α rows and β per token."""
        words = [self.vocab.tokens[i] for i in hypothesis.tokens]  # one word per α row, <unk> kept
        return {
            "image_id": image_id,
            "file_name": file_name,
            "caption": " ".join(words),
            "tokens": words,
            "grid": list(grid),
            "image_size": list(image_size),
            "alphas": [[round(float(a), 6) for a in row] for row in hypothesis.alphas.tolist()],
            "betas": [round(float(b), 6) for b in hypothesis.betas.tolist()],
        }

    def _evaluation_step(self, batch, stage: str) -> None:  # noqa: ANN001 - EvalCaptionBatch
        if batch is None:
            return
        self._loss(batch.images, self.encode_references(batch.references), stage)
        hypotheses, grid = self.decode(batch.images)
        size = (batch.images.shape[-2], batch.images.shape[-1])
        for image_id, references, hypothesis in zip(batch.image_ids, batch.references, hypotheses, strict=True):
            record = self.to_record(image_id, hypothesis, grid, size)
            record["references"] = list(references)
            self._outputs.append(record)

    def validation_step(self, batch, batch_idx: int) -> None:  # noqa: ANN001
        start = len(self._outputs)
        self._evaluation_step(batch, "val")
        if batch is not None and batch_idx == 0 and self.hparams.log_overlays > 0 and not self.trainer.sanity_checking \
                and self.trainer.is_global_zero:
            count = self.hparams.log_overlays
            self._overlay_examples = list(zip(batch.images[:count].detach(), self._outputs[start:start + count],
                                              strict=False))

    def test_step(self, batch, batch_idx: int) -> None:  # noqa: ANN001
        self._evaluation_step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self._outputs = []

    def on_test_epoch_start(self) -> None:
        self._outputs = []

    def _gathered_outputs(self) -> list[dict[str, Any]]:
        """Every rank's records, deduplicated by image id (DDP pads ranks with repeated images)."""
        outputs = self._outputs
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[list[dict[str, Any]] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, outputs)
            outputs = [record for part in gathered for record in (part or [])]
        return sorted(deduplicate(outputs), key=lambda record: str(record["image_id"]))

    def _score(self, records: list[dict[str, Any]], stage: str) -> dict[str, float]:
        scores: dict[str, float] = {}
        if self.trainer.is_global_zero and records:
            predictions = {r["image_id"]: r["caption"] for r in records}
            references = {r["image_id"]: r["references"] for r in records}
            scores = caption_scores(predictions, references)
            boxes = self._boxes(stage)
            if boxes:
                scores.update(pointing_scores(records, boxes))
            scores["images"] = float(len(records))
        return self.trainer.strategy.broadcast(scores, src=0)

    def _boxes(self, stage: str) -> dict:
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "boxes"):
            return {}
        return datamodule.boxes(datamodule.splits["val" if stage == "val" else "test"])

    def _finish_evaluation(self, stage: str) -> list[dict[str, Any]]:
        records = self._gathered_outputs()
        if self.trainer.sanity_checking:
            return records
        for name, value in self._score(records, stage).items():
            if not math.isnan(value):
                self.log(f"{stage}/{name}", value, rank_zero_only=False, sync_dist=False)
        return records

    def on_train_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "train")

    def on_validation_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "val")
        self._finish_evaluation("val")
        self._outputs = []
        if self._overlay_examples:
            self._log_overlays()

    def _log_overlays(self) -> None:
        """The paper's figure (image, then α_t per word) for the first validation images, to the logger."""
        mean, std = self.hparams.mean or IMAGENET_MEAN, self.hparams.std or IMAGENET_STD
        figures = []
        for index, (image, record) in enumerate(self._overlay_examples):
            shown = to_pil(denormalize(image, mean, std))
            figures.append((f"val_overlay/{index}", caption_overlay(shown, record, panel_size=128, columns=6)))
        self._overlay_examples = []
        log_figures(self.loggers, figures, step=self.global_step, fallback_dir=self.trainer.default_root_dir)

    def on_test_epoch_end(self) -> None:
        report_skipped_images(self.trainer, "test")
        records = self._finish_evaluation("test")
        path = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "results_test.json"  # a collective
        if self.trainer.is_global_zero and records:
            payload = [{k: v for k, v in record.items() if k != "references"} for record in records]
            log.info("wrote %d results to %s", len(payload), write_json_atomically(path, payload))
        self._outputs = []

    # --------------------------------------------------------------------------------------- plumbing
    def on_fit_start(self) -> None:
        """Save the vocabulary as plain JSON next to the checkpoints (it is inside them too, as a list)."""
        start, epochs = self.hparams.self_critical_from_epoch, self.trainer.max_epochs
        if start is not None and epochs is not None and 0 <= epochs <= start:
            log.warning("self_critical_from_epoch is %d but max_epochs is %d: training ends before any "
                        "self-critical epoch", start, epochs)
        callback = self.trainer.checkpoint_callback
        if self.trainer.is_global_zero and callback is not None and getattr(callback, "dirpath", None):
            Path(callback.dirpath).mkdir(parents=True, exist_ok=True)
            self.vocab.to_json(Path(callback.dirpath) / "vocab.json")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint[KIND_KEY] = "captioner"
        checkpoint[RNG_KEY] = capture_rng_state()  # for an exact resume: augmentation and dropout continue

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint whose words differ from this run's vocabulary: its ids would mean other words."""
        require_kind(checkpoint.get(KIND_KEY), "captioner", training=True)
        saved = list(checkpoint.get("hyper_parameters", {}).get("vocabulary") or [])
        if saved and saved != list(self.vocab.tokens):
            where = next((i for i, (a, b) in enumerate(zip(saved, self.vocab.tokens, strict=False)) if a != b),
                         min(len(saved), len(self.vocab.tokens)))
            raise CheckpointError(
                f"the checkpoint's vocabulary ({len(saved)} tokens) does not match the data's ({len(self.vocab)} "
                f"tokens; first difference at id {where}); pass the vocab.json saved beside the checkpoint as "
                "--data.init_args.vocab_file"
            )
        restore_rng_state(checkpoint.get(RNG_KEY))

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        encoder_params = [p for p in self.encoder.parameters() if p.requires_grad]
        groups = [{"params": list(self.decoder.parameters()), "lr": self.hparams.lr}]
        if encoder_params:
            groups.append({"params": encoder_params, "lr": self.hparams.encoder_lr or self.hparams.lr})
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        steps_per_epoch = total_steps / max(1, self.trainer.max_epochs or 1)
        warmup_steps = max(1, round(self.hparams.warmup_epochs * steps_per_epoch))
        schedule = warmup_cosine(optimizer, warmup_steps=warmup_steps, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
