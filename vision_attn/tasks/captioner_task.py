"""The Show-Attend-Tell captioner as a LightningModule: its steps, what they log, its optimiser's groups."""

from __future__ import annotations

import logging
import math
from typing import Any

from PIL import Image
from torch import Tensor, nn

from vision_attn.captioning.captioner import Captioner
from vision_attn.captioning.compiled import compile_decoder, real_part, runs_compiled, static_batch
from vision_attn.captioning.decoder import DecoderOutput
from vision_attn.captioning.evaluation import EvaluationRecords, caption_figures, score_records
from vision_attn.captioning.extensions import AUXILIARY
from vision_attn.captioning.likelihood import likelihood_objective, token_likelihood
from vision_attn.captioning.options import (
    CaptionerOptimiser,
    DecoderOptions,
    DecodingOptions,
    EncoderOptions,
    ObjectiveOptions,
    ObjectNames,
    SelfCriticalOptions,
)
from vision_attn.captioning.reinforce import HardAttentionReinforce
from vision_attn.captioning.seams import TermResult, TrainingStep, built
from vision_attn.captioning.self_critical import SelfCriticalObjective
from vision_attn.checkpoint import CAPTIONER
from vision_attn.data.caption_datasets import CaptionBatch, EvalCaptionBatch
from vision_attn.data.feature_cache import FrozenPart
from vision_attn.option_groups import ImageFormat, Schedule
from vision_attn.tasks.base import BaseTask
from vision_attn.tasks.predictions import CaptionPredictions, write_run_results

log = logging.getLogger(__name__)
OPTIMISER = CaptionerOptimiser(lr=4e-4)  # the paper's rate (Xu et al. 2015 trained with Adam)


class CaptionerTask(CaptionPredictions, BaseTask):
    """Trains a ``Captioner`` by likelihood (with the doubly stochastic term, and REINFORCE for hard attention) or,
    from the point ``self_critical`` names, self-critically; validation and test beam-search and log the COCO
    metrics, pointing and the scene metrics; ``test`` writes ``<log dir>/results_test.json``, ``predict``
    ``<log dir>/predictions.json``.

    Args:
        log_overlays: after each validation, log the attention of this many validation images (0: none)
    """

    kind = CAPTIONER

    def __init__(self, *, vocabulary: list[str] | None = None, image: ImageFormat | None = None,
                 objects: ObjectNames | None = None, encoder: EncoderOptions = EncoderOptions(),
                 decoder: DecoderOptions = DecoderOptions(), decoding: DecodingOptions = DecodingOptions(),
                 objective: ObjectiveOptions = ObjectiveOptions(),
                 self_critical: SelfCriticalOptions = SelfCriticalOptions(), optimiser: CaptionerOptimiser = OPTIMISER,
                 schedule: Schedule = Schedule(), log_overlays: int = 4) -> None:
        super().__init__(optimiser=CaptionerOptimiser.coerce(optimiser, OPTIMISER), schedule=schedule,
                         log_overlays=log_overlays)
        image, objects, encoder = ImageFormat.coerce(image), ObjectNames.coerce(objects), EncoderOptions.coerce(encoder)
        decoding = DecodingOptions.coerce(decoding)
        self.objective = ObjectiveOptions.coerce(objective)
        self.model = Captioner(vocabulary=vocabulary or [], image=image, encoder=encoder, decoder=decoder,
                               decoding=decoding)
        if self.model.decoder.options.compile:  # fit, validate and test; `caption` and the API stay eager
            compile_decoder(self.model.decoder, self.model.decoder.options.compile)
        self.auxiliary = nn.ModuleDict(built(
            self.objective.auxiliary, AUXILIARY, objects=objects, vocab=self.model.vocab,
            annotation_dim=self.model.encoder.annotation_dim, pretrained=encoder.pretrained,
            pretrained_with=self.model.encoder.pretrained_with))
        self.reinforce = HardAttentionReinforce(self.objective)
        self.self_critical = SelfCriticalObjective(SelfCriticalOptions.coerce(self_critical), self.model.vocab,
                                                   decoding.max_length)
        self.evaluation = EvaluationRecords()
        self.save_options(vocabulary=list(self.model.vocab.tokens), image=image, objects=objects,
                          encoder=self.model.encoder.options, decoder=self.model.decoder.options, decoding=decoding,
                          objective=self.objective, self_critical=self.self_critical.options,
                          optimiser=self.optimiser, schedule=self.schedule.options, log_overlays=log_overlays)

    def training_loss(self, batch: CaptionBatch) -> Tensor:
        """The NLL with the doubly stochastic term (REINFORCE for hard attention), or once started the self-critical
        loss; plus the auxiliary terms; logged as train/loss."""
        switch = self.self_critical.options
        if switch.enabled and self.schedule.phase_started("self-critical training", epoch=switch.from_epoch,
                                                          share=switch.from_progress):
            return self._self_critical_loss(batch)
        return self._likelihood_loss(batch.images, batch.captions, "train", batch.caption_images, batch.objects,
                                     features=batch.features)

    def _likelihood_loss(self, images: Tensor, captions: Tensor, stage: str, caption_images: Tensor | None = None,
                         objects: Tensor | None = None, *, features: bool = False) -> Tensor:
        captions = captions.long()
        annotations, grid = self.model.encoder.encode(images, features=features)
        output = self._teacher_forced(annotations, captions, caption_images)
        likelihood = token_likelihood(output.logits, captions)
        weight = self.objective.doubly_stochastic_weight
        terms = likelihood_objective(likelihood, output.alphas, weight, self.objective.loss_normalisation)
        said = TrainingStep(annotations, grid, captions, caption_images, objects, captions[:, 1:], output.alphas,
                            caption_images)
        loss = self._auxiliary(terms.nll, said, stage)
        if terms.penalty is not None:  # + λ Σ_i (1 − Σ_t α_ti)², normalised
            loss = loss + weight * terms.penalty
            self.log(f"{stage}/ds_penalty", terms.penalty, batch_size=len(captions))
        if output.location_log_probs is not None:  # hard attention: − REINFORCE's surrogate, scaled as the NLL
            loss = loss - self.reinforce(output, likelihood) / terms.caption_scale
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=len(captions))
        return loss

    def _teacher_forced(self, annotations: Tensor, captions: Tensor, caption_images: Tensor | None) -> DecoderOutput:
        # compiled, the pass runs at static shapes (no recompiling for other caption counts) and is cut back
        if not runs_compiled(self.model.decoder, annotations.device):
            return self.model.teacher_forced(annotations, captions, caption_images)
        padded_annotations, padded = static_batch(annotations, captions, caption_images,
                                                  width=self.model.decoding.max_length + 2)
        return real_part(self.model.decoder(padded_annotations, padded), len(captions), captions.shape[1] - 1)

    def _self_critical_loss(self, batch: CaptionBatch) -> Tensor:
        if self.self_critical.reward is None:  # CIDEr-D's document frequencies: every training image's references
            references = [record.captions for record in self.trainer.datamodule.records("train")]
            self.self_critical.use_references(references)
            log.info("self-critical training from step %d (epoch %d): CIDEr-D reward over the references of %d "
                     "training images", self.global_step, self.current_epoch, len(references))
        annotations, grid = self.model.encoder.encode(batch.images, features=batch.features)
        sampled = self.self_critical(self.model.decoder, annotations, batch, list(self.model.processors))
        said = TrainingStep(annotations, grid, batch.captions.long(), batch.caption_images, batch.objects,
                            sampled.tokens, sampled.alphas, sampled.sample_images)
        loss = self._auxiliary(sampled.loss, said, "train")
        self.log("train/reward", sampled.rewards.mean(), prog_bar=True, batch_size=len(sampled.rewards))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(sampled.rewards))
        return loss

    def _auxiliary(self, loss: Tensor, step: TrainingStep, stage: str) -> Tensor:
        for term in self.auxiliary.values():
            result: TermResult | None = term(step)
            if result is None:  # the batch lacks what the term reads
                continue
            for name, (value, count) in result.logs.items():
                self.log(f"{stage}/{name}", value, batch_size=count, sync_dist=stage != "train")
            loss = loss + result.loss
        return loss

    def _evaluation_step(self, batch: EvalCaptionBatch | None, stage: str) -> list[dict[str, Any]]:
        if batch is None:
            return []
        references = self.model.encode_captions([refs[0] for refs in batch.references])
        self._likelihood_loss(batch.images, references, stage, features=batch.features)
        return self.evaluation.add(self.model, batch)

    def validation_step(self, batch: EvalCaptionBatch | None, batch_idx: int) -> list[dict[str, Any]]:
        """val/loss on each image's first reference, and the beam-searched records kept for scoring (returned)."""
        return self._evaluation_step(batch, "val")

    def test_step(self, batch: EvalCaptionBatch | None, batch_idx: int) -> list[dict[str, Any]]:
        """test/loss on each image's first reference, and the beam-searched records kept for scoring (returned)."""
        return self._evaluation_step(batch, "test")

    def _finish_evaluation(self, stage: str) -> list[dict[str, Any]]:
        # every rank's records gathered; rank 0 scores them, every rank logs the scores
        records = self.evaluation.gather()
        if not self.trainer.sanity_checking:
            data = self.trainer.datamodule
            words = getattr(data, "object_words", None)  # the DataModule's object-words table, if it has one
            scale = data.box_scale(stage) if hasattr(data, "box_scale") else None  # its boxes to the input's pixels
            scores = score_records(records, words=words, box_scale=scale) if self.trainer.is_global_zero and records \
                else {}
            for name, value in self.trainer.strategy.broadcast(scores, src=0).items():
                if not math.isnan(value):  # NaN: pointing on a split whose captions name no object
                    self.log(f"{stage}/{name}", value, rank_zero_only=False, sync_dist=False)
        return records

    def on_validation_epoch_end(self) -> None:
        """Score the validation records and log them as val/<metric> (not in the sanity check)."""
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        """Score the test records as test/<metric>, and rank 0 writes them to ``results_test.json``."""
        write_run_results(self.trainer, self._finish_evaluation("test"), "results_test.json")

    def overlay_figures(self, batch: EvalCaptionBatch, outputs: list[dict[str, Any]],
                        count: int) -> list[tuple[str, Image.Image]]:
        """α over the image for each word of the first ``count`` decoded captions (none from cached features)."""
        if batch.features:  # no pixels to draw on
            return []
        return caption_figures(batch.images[:count], outputs[:count], self.model.mean, self.model.std)

    def frozen_encoder_part(self) -> FrozenPart | None:
        """The encoder's frozen part, whose output a DataModule may cache; None if none."""
        return self.model.encoder.frozen_features()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint whose words differ from this run's vocabulary: its ids would mean other words."""
        super().on_load_checkpoint(checkpoint)
        self.model.vocab.require_same(checkpoint.get("hyper_parameters", {}).get("vocabulary"))

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The decoder with the auxiliary terms' heads at ``lr``, the encoder's trainable stages at ``encoder_lr``."""
        groups = [{"params": list(self.model.decoder.parameters()) + list(self.auxiliary.parameters()),
                   "lr": self.optimiser.lr}]
        encoder_params = [p for p in self.model.encoder.parameters() if p.requires_grad]
        if encoder_params:
            groups.append({"params": encoder_params, "lr": self.optimiser.encoder_lr or self.optimiser.lr})
        return groups
