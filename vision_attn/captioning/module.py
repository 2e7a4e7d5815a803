"""LightningModule for the Show-Attend-Tell captioner: the likelihood and self-critical steps, and the optimiser.

Decoding, the results records, gathering, scoring and writing live in ``captioning/evaluation.py``; the
checkpoint kind, the non-finite guard, warm-up + cosine and the overlay logging in ``task.py``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn

from vision_attn.captioning.beam_search import sample_captions
from vision_attn.captioning.decoder import AttentionMode
from vision_attn.captioning.evaluation import EvaluationRecords, caption_figures, reference_reward, score_records
from vision_attn.captioning.losses import (
    LossNormalisation,
    check_loss_normalisation,
    check_self_critical_options,
    concept_loss,
    concept_targets,
    consensus_recall,
    excess_words,
    grounding_loss,
    grounding_targets,
    likelihood_objective,
    object_loss,
    reinforce_surrogate,
    self_critical_loss,
    token_likelihood,
)
from vision_attn.captioning.model import Captioner
from vision_attn.checkpoint import CAPTIONER, constructor_args, extract_state_dict, load_file
from vision_attn.data.coco import CaptionBatch, EvalCaptionBatch, load_caption_image
from vision_attn.data.feature_cache import FeatureCache, images_digest, tensors_digest
from vision_attn.data.images import load_or_skip
from vision_attn.data.scenes import COLOURS
from vision_attn.data.vocabulary import END_ID, PAD_ID, START_ID, word_ids
from vision_attn.errors import CheckpointError
from vision_attn.io import output_folder
from vision_attn.metrics import CiderD
from vision_attn.results import write_results
from vision_attn.task import BaseTask

log = logging.getLogger(__name__)


# The Fashion scenes default's encoder is pretrained by ITEMS_CONFIG, which writes under ITEMS_RUN
ITEMS_CONFIG, ITEMS_RUN = "configs/captioner/fashion_scene_items.yaml", "runs/encoder_fashion_scene_items/"


def check_pretraining_normalisation(model: Captioner, source: str | None) -> None:
    """Refuse, in one line, an encoder pretrained on images normalised otherwise than this captioner's."""
    learnt = model.encoder.pretrained_with
    for name, ours in (("mean", model.mean), ("std", model.std)):
        theirs = learnt.get(name)
        if theirs is not None and not torch.allclose(torch.tensor(theirs, dtype=torch.float64),
                                                     torch.tensor(ours, dtype=torch.float64)):
            raise CheckpointError(f"{source}: the encoder was pretrained on images normalised with {name} "
                                  f"{list(theirs)}, but this captioner's {name} is {list(ours)}")


class ShowAttendTell(BaseTask):
    """Trains a ``Captioner`` with teacher forcing (plus the doubly stochastic term, and REINFORCE for hard
    attention); decodes with beam search in validation and test, which log the COCO metrics and pointing.

    From epoch ``self_critical_from_epoch`` (default never), or once ``self_critical_from_time`` of the trainer's
    ``max_time`` is spent (a fraction, so the switch comes at the same point of the budget on any machine),
    training is self-critical instead (Rennie et al. 2017): ``self_critical_samples`` captions are drawn per
    image from the decoder, each is rewarded by its CIDEr-D against the image's references, and REINFORCE
    raises the ones that beat their siblings' mean; ``repeat_penalty`` is taken off the reward for every word a
    sample uses more often than any of its references does (a repeated object), and ``recall_reward`` × the
    fraction of the words every reference uses (on scenes, each object's colour and class) that the sample
    uses is added to it (an object left out). ``loss_normalisation`` scales the likelihood and the doubly
    stochastic term λ·Σ_i (1 − Σ_t α_ti)²: ``paper`` as the authors' code does (NLL summed over each caption,
    penalty averaged over locations; see ``losses.likelihood_objective``), ``token`` per token and per caption.
    Self-critical training needs grouped captions (``group_captions: true``). With ``schedule_by_time`` the
    learning rate's cosine follows the ``max_time`` budget when that is further along than the steps.
    ``coverage`` and ``concept_weight`` are described in the README ("Coverage and the concept loss").
    ``vocabulary`` (linked from the DataModule by the CLI), ``image_size``, ``mean`` and ``std`` are stored
    with the checkpoint, so ``caption`` needs nothing else.
    ``test`` writes the SPEC §4 results to ``<log dir>/results_test.json``.
    """

    kind = CAPTIONER

    def __init__(
        self, *, vocabulary: list[str] | None = None, backbone: str = "small", encoder_width: int = 32,
        encoder_stride: int = 16, grid_size: int | None = None, pretrained_encoder: str | None = None,
        vit: dict | None = None,
        trainable_stages: int = -1, embed_dim: int = 512, hidden_dim: int = 512, attention_dim: int = 512,
        dropout: float = 0.5, attention_mode: AttentionMode = "soft", initial_gate: float = 0.5, coverage: bool = False,
        attend_with_word: bool = False, word_counts: bool = False, word_count_context: bool = False,
        attention_score: str = "additive",
        attention_heads: int = 4,
        doubly_stochastic_weight: float = 0.0, loss_normalisation: LossNormalisation = "paper",
        concept_weight: float = 0.0, object_weight: float = 0.0, grounding_weight: float = 0.0,
        object_heads_from_encoder: bool = False, object_classes: list[str] | None = None,
        object_colours: list[str] | None = None, hard_expectation_prob: float = 0.5,
        reinforce_weight: float = 1.0, entropy_weight: float = 0.01, baseline_decay: float = 0.9,
        self_critical_from_epoch: int | None = None, self_critical_from_time: float | None = None,
        self_critical_samples: int = 5, repeat_penalty: float = 0.0, recall_reward: float = 0.0,
        schedule_by_time: bool = False, feature_cache: str | None = None,
        feature_cache_shard_size: int = 256, lr: float = 4e-4,
        encoder_lr: float | None = None, weight_decay: float = 0.0,
        warmup_epochs: float = 0.0, beam_size: int = 3, max_decode_length: int = 20, length_penalty: float = 0.0,
        image_size: int = 224, mean: list[float] | None = None, std: list[float] | None = None, log_overlays: int = 4,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        check_self_critical_options(self_critical_from_epoch, self_critical_samples, self_critical_from_time)
        self.save_hyperparameters()
        if pretrained_encoder and ITEMS_RUN in pretrained_encoder and not Path(pretrained_encoder).exists():
            raise CheckpointError(f"{pretrained_encoder}: no such file; pretrain the encoder first with "
                                  f"`vision-attn fit --config {ITEMS_CONFIG}`")
        self.model = Captioner(**constructor_args(Captioner, self.hparams))
        if backbone == "vit":  # the ViT's architecture, so that the checkpoint rebuilds it without the ViT's file
            self.hparams["vit"] = self.model.encoder.vit_options
        check_pretraining_normalisation(self.model, pretrained_encoder)
        if feature_cache and self.model.encoder.frozen_part() is None:
            raise ValueError("feature_cache needs a frozen encoder, whose output never changes: set "
                             "trainable_stages to 0 (all frozen) or to fewer stages than the trunk has")
        if feature_cache:
            output_folder(feature_cache)  # not a file, not under one: refused here, before any work
        if feature_cache_shard_size < 1:
            raise ValueError(f"feature_cache_shard_size must be at least 1, got {feature_cache_shard_size}")
        check_loss_normalisation(loss_normalisation)
        for name, value in (("concept_weight", concept_weight), ("repeat_penalty", repeat_penalty),
                            ("recall_reward", recall_reward), ("object_weight", object_weight),
                            ("grounding_weight", grounding_weight)):
            if value < 0:
                raise ValueError(f"{name} must be 0 or more, got {value}")
        for name, value in (("object_weight", object_weight), ("grounding_weight", grounding_weight)):
            if value > 0 and not object_classes:
                raise ValueError(f"{name} needs the training images' objects: set the DataModule's "
                                 "object_targets: true (it reads the train split's instances file)")
        # A training aid, not part of the captioner: scores of every word at every location (concept_loss)
        self.concept_head = nn.Linear(self.model.encoder.annotation_dim, len(self.model.vocab)) \
            if concept_weight > 0 else None
        if self.concept_head is not None:  # σ(−5) per location: a noisy-OR over tens of locations starts near 0.2,
            nn.init.constant_(self.concept_head.bias, -5.0)  # not near 1 for every word (which swamps the loss)
        # Training aids too: each object's class and colour from the annotation vectors under its box (object_loss)
        dim = self.model.encoder.annotation_dim
        self.object_head = nn.Linear(dim, len(object_classes)) if object_weight > 0 else None
        self.object_colour_head = nn.Linear(dim, len(object_colours)) if object_weight > 0 and object_colours \
            else None
        if object_heads_from_encoder:
            self._object_heads_from(pretrained_encoder)
        # the vocabulary ids of the object classes' and colours' words (−1: not a word of the vocabulary)
        vocab = self.model.vocab
        self.register_buffer("class_word_ids", torch.tensor(
            [vocab.id(name) if name in vocab else -1 for name in object_classes or []], dtype=torch.long),
            persistent=False)
        self.register_buffer("colour_word_ids", torch.tensor(
            [vocab.id(name) if name in vocab else -1 for name in object_colours or []], dtype=torch.long),
            persistent=False)
        self.register_buffer("reward_baseline", torch.zeros(()))  # b, the moving average of log p(y | s, a)
        self._cider: CiderD | None = None  # the self-critical reward, built from the training references
        self._evaluation = EvaluationRecords()
        self._budget_used: Callable[[], float] | None = None  # the fraction of max_time spent, set at fit start
        self._self_critical_from_step: int | None = None  # when the time budget turned training self-critical

    # ----------------------------------------------------------------------------------------- training
    def _likelihood_loss(self, images: Tensor, captions: Tensor, stage: str,
                         caption_images: Tensor | None = None, objects: Tensor | None = None) -> Tensor:
        captions = captions.long()
        annotations, grid = self.model.encoder(images)
        output = self.model.teacher_forced(annotations, captions, caption_images)
        likelihood = token_likelihood(output.logits, captions)
        objective = likelihood_objective(likelihood, output.alphas, self.hparams.doubly_stochastic_weight,
                                         self.hparams.loss_normalisation)
        loss = objective.nll + self._concept_loss(annotations, captions, caption_images, stage) \
            + self._object_loss(annotations, grid, objects, stage) \
            + self._grounding_loss(captions[:, 1:], output.alphas, objects, caption_images, grid, stage)
        if objective.penalty is not None:  # + λ Σ_i (1 − Σ_t α_ti)², normalised
            loss = loss + self.hparams.doubly_stochastic_weight * objective.penalty
            self.log(f"{stage}/ds_penalty", objective.penalty, batch_size=len(captions))
        if output.location_log_probs is not None:
            surrogate = reinforce_surrogate(
                -likelihood.per_caption, output.location_log_probs, output.location_entropy, likelihood.mask,
                baseline=float(self.reward_baseline), reinforce_weight=self.hparams.reinforce_weight,
                entropy_weight=self.hparams.entropy_weight,
            )
            loss = loss - surrogate.sum() / objective.caption_scale  # summed over captions, scaled as the NLL
            decay = self.hparams.baseline_decay  # b ← decay·b + (1 − decay)·log p(y | s, a)
            self.reward_baseline.mul_(decay).add_((1 - decay) * -likelihood.per_caption.detach().mean())
        self.log(f"{stage}/loss", loss, prog_bar=True, sync_dist=stage != "train", batch_size=len(captions))
        return loss

    def _concept_loss(self, annotations: Tensor, captions: Tensor, caption_images: Tensor | None,
                      stage: str) -> Tensor | float:
        """concept_weight × the multiple-instance loss of the captions' words over the locations (0 when off)."""
        if self.concept_head is None:
            return 0.0
        ignore = torch.tensor([PAD_ID, START_ID, END_ID], device=captions.device)
        targets = concept_targets(captions, caption_images, len(annotations), len(self.model.vocab), ignore)
        loss = concept_loss(self.concept_head(annotations), targets, ignore)
        self.log(f"{stage}/concept_loss", loss, batch_size=len(annotations), sync_dist=stage != "train")
        return self.hparams.concept_weight * loss

    def _object_heads_from(self, source: str | None) -> None:
        """Start the object heads from the classifier heads of the encoder's pretraining (``pretraining``), which
        read a class and a colour from the pooled annotation vectors as the object loss does: a linear probe before
        fine-tuning keeps more of the pretrained features than a head started at random, whose first gradients
        reach the encoder as noise (LP-FT, Kumar et al. 2022). One line of refusal when there are no such heads
        or they name other classes or colours."""
        if self.object_head is None:
            raise ValueError("object_heads_from_encoder needs the object loss: set object_weight above 0")
        if not source:
            raise ValueError("object_heads_from_encoder needs pretrained_encoder: an encoder pretraining checkpoint")
        hparams = self.model.encoder.pretrained_with  # the file's hyper-parameters, kept when its trunk loaded
        state = extract_state_dict(load_file(source))  # the heads, which the trunk's loading leaves out
        if "head.weight" not in state or hparams.get("class_names") is None:
            raise CheckpointError(f"{source}: not an encoder pretraining checkpoint with class heads "
                                  "(`vision-attn fit --config configs/captioner/fashion_scene_items.yaml`), so "
                                  "object_heads_from_encoder has no heads to start from")
        ours = list(self.hparams.object_classes)
        if list(hparams["class_names"]) != ours:
            raise CheckpointError(f"{source}: the pretrained head's classes {list(hparams['class_names'])} are not "
                                  f"this captioner's object classes {ours}")
        heads = [(self.object_head, "head")]
        if self.object_colour_head is not None:
            theirs = list(COLOURS)[:hparams.get("num_colours", 0)]  # the items' colours are scenes.COLOURS, in order
            if theirs != list(self.hparams.object_colours) or "colour_head.weight" not in state:
                raise CheckpointError(f"{source}: the pretrained colour head's colours {theirs} are not this "
                                      f"captioner's object colours {list(self.hparams.object_colours)}")
            heads.append((self.object_colour_head, "colour_head"))
        with torch.no_grad():
            for head, prefix in heads:
                head.weight.copy_(state[f"{prefix}.weight"])
                head.bias.copy_(state[f"{prefix}.bias"])

    def _object_loss(self, annotations: Tensor, grid: tuple[int, int], objects: Tensor | None,
                     stage: str) -> Tensor | float:
        """object_weight × the loss of each object's class and colour from the vectors under its box (0 when off,
        or when the batch carries no objects, as in validation)."""
        if self.object_head is None or objects is None:
            return 0.0
        result = object_loss(annotations, grid, objects, self.object_head, self.object_colour_head)
        if result.objects:
            self.log(f"{stage}/object_loss", result.loss, batch_size=result.objects)
            self.log(f"{stage}/object_acc", result.accuracy, batch_size=result.objects)
        return self.hparams.object_weight * result.loss

    def _grounding_loss(self, tokens: Tensor, alphas: Tensor, objects: Tensor | None, caption_images: Tensor | None,
                        grid: tuple[int, int], stage: str) -> Tensor | float:
        """grounding_weight × the cross-entropy of α against the box of the object each word names (0 when off,
        or when the batch carries no objects)."""
        if not self.hparams.grounding_weight or objects is None:
            return 0.0
        per_caption = objects if caption_images is None else objects[caption_images]  # (B, K, 6) -> (N, K, 6)
        target, mask = grounding_targets(tokens, per_caption, grid, self.class_word_ids, self.colour_word_ids)
        loss = grounding_loss(alphas, target, mask)
        self.log(f"{stage}/grounding_loss", loss, batch_size=len(tokens))
        return self.hparams.grounding_weight * loss

    def training_loss(self, batch: CaptionBatch) -> Tensor:
        if self.self_critical:
            return self._self_critical_loss(batch)
        return self._likelihood_loss(batch.images, batch.captions, "train", batch.caption_images, batch.objects)

    @property
    def self_critical(self) -> bool:
        """Whether training is now on the model's own samples with the CIDEr-D reward instead of by likelihood:
        from epoch ``self_critical_from_epoch``, or from the step at which ``self_critical_from_time`` of the
        time budget was spent (and from then on)."""
        start = self.hparams.self_critical_from_epoch
        if start is not None and self.current_epoch >= start:
            return True
        if self._self_critical_from_step is None and self._budget_used is not None and self._switch_is_due():
            self._self_critical_from_step = self.global_step
            log.info("%.0f%% of the time budget spent at step %d: training is self-critical from here",
                     100 * self.hparams.self_critical_from_time, self.global_step)
        return self._self_critical_from_step is not None and self.global_step >= self._self_critical_from_step

    def _switch_is_due(self) -> bool:
        """Whether ``self_critical_from_time`` of the budget is spent, as rank 0's clock says (every rank switches
        at the same step, as Lightning's Timer stops them together)."""
        due = self._budget_used() >= self.hparams.self_critical_from_time
        return bool(self.trainer.strategy.broadcast(due, src=0)) if self.trainer.world_size > 1 else due

    def _reward(self) -> CiderD:
        """CIDEr-D with the document frequencies of every training image's references, built once."""
        if self._cider is None:
            if not hasattr(self.trainer.datamodule, "records"):
                raise ValueError("self-critical training needs the training references: use CocoCaptionsDataModule")
            references = [record.captions for record in self.trainer.datamodule.records("train")]
            self._cider = reference_reward(references, self.model.vocab, self.hparams.max_decode_length)
            log.info("self-critical training from step %d (epoch %d): CIDEr-D reward over the references of %d "
                     "training images", self.global_step, self.current_epoch, len(references))
        return self._cider

    def _self_critical_loss(self, batch: CaptionBatch) -> Tensor:
        """n captions sampled per image, rewarded by CIDEr-D against the image's references in the batch, each
        compared with the mean reward of its siblings."""
        if batch.caption_images is None:
            raise ValueError("self-critical training needs every reference of an image in its batch: set the "
                             "DataModule's group_captions: true")
        samples_per_image = self.hparams.self_critical_samples
        annotations, grid = self.model.encoder(batch.images)
        sampled = sample_captions(self.model.decoder, annotations, per_image=samples_per_image, start_id=START_ID,
                                  end_id=END_ID, pad_id=PAD_ID, max_length=self.hparams.max_decode_length)
        references = batch.word_ids_per_image()
        candidates = [word_ids(caption) for caption in sampled.tokens.tolist()]
        their_references = [references[n // samples_per_image] for n in range(len(candidates))]
        scores = self._reward()(candidates, their_references)
        if self.hparams.repeat_penalty:  # r = CIDEr-D − penalty × the words used more often than any reference does
            scores = [score - self.hparams.repeat_penalty * excess_words(candidate, refs)
                      for score, candidate, refs in zip(scores, candidates, their_references, strict=True)]
        if self.hparams.recall_reward:  # r += weight × the fraction of the words every reference uses that it uses
            scores = [score + self.hparams.recall_reward * consensus_recall(candidate, refs)
                      for score, candidate, refs in zip(scores, candidates, their_references, strict=True)]
        rewards = torch.tensor(scores, dtype=sampled.log_probs.dtype, device=sampled.log_probs.device)
        loss = self_critical_loss(sampled.log_probs, sampled.mask, rewards, samples_per_image).sum()
        loss = loss / sampled.mask.sum().clamp_min(1)
        sample_images = torch.arange(len(annotations), device=annotations.device).repeat_interleave(samples_per_image)
        loss = loss + self._concept_loss(annotations, batch.captions.long(), batch.caption_images, "train") \
            + self._object_loss(annotations, grid, batch.objects, "train") \
            + self._grounding_loss(sampled.tokens, sampled.alphas, batch.objects, sample_images, grid, "train")
        self.log("train/reward", rewards.mean(), prog_bar=True, batch_size=len(candidates))
        self.log("train/loss", loss, prog_bar=True, batch_size=len(candidates))
        return loss

    # ------------------------------------------------------------------------------------- evaluation
    def _evaluation_step(self, batch: EvalCaptionBatch | None, stage: str) -> list[dict[str, Any]]:
        if batch is None:
            return []
        self._likelihood_loss(batch.images, self.model.encode_captions([refs[0] for refs in batch.references]), stage)
        return self._evaluation.add(self.model, batch)

    def validation_step(self, batch: EvalCaptionBatch | None, batch_idx: int) -> list[dict[str, Any]]:
        return self._evaluation_step(batch, "val")

    def test_step(self, batch: EvalCaptionBatch | None, batch_idx: int) -> list[dict[str, Any]]:
        return self._evaluation_step(batch, "test")

    def _finish_evaluation(self, stage: str) -> list[dict[str, Any]]:
        """Gather every rank's records; rank 0 scores them, every rank logs the scores."""
        records = self._evaluation.gather()
        if not self.trainer.sanity_checking:
            scores = score_records(records) if self.trainer.is_global_zero and records else {}
            for name, value in self.trainer.strategy.broadcast(scores, src=0).items():
                if not math.isnan(value):  # NaN: pointing on a split whose captions name no object
                    self.log(f"{stage}/{name}", value, rank_zero_only=False, sync_dist=False)
        return records

    def on_validation_epoch_end(self) -> None:
        self._finish_evaluation("val")

    def on_test_epoch_end(self) -> None:
        records = self._finish_evaluation("test")
        path = Path(self.trainer.log_dir or self.trainer.default_root_dir) / "results_test.json"  # a collective
        if self.trainer.is_global_zero and records:
            log.info("wrote %d results to %s", len(records), write_results(path, records))

    def overlay_figures(self, batch: EvalCaptionBatch, outputs: list[dict[str, Any]],
                        count: int) -> list[tuple[str, Image.Image]]:
        if self.model.encoder.cached_input:  # the batch holds cached features, not pixels to draw on
            if not getattr(self, "_said_no_overlays", False):
                log.info("attention overlays are not logged while validation reads cached features")
                self._said_no_overlays = True
            return []
        return caption_figures(batch.images[:count], outputs[:count], self.model.mean, self.model.std)

    # ----------------------------------------------------------------------------------- feature cache
    def setup(self, stage: str) -> None:
        """With ``feature_cache``, fill the cache of each split this stage reads (train and val for fit), on
        every rank its share, and have the DataModule serve the cached features instead of the images."""
        if not self.hparams.feature_cache:
            return
        roles = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(stage, ())
        datamodule = self.trainer.datamodule
        caches = feature_caches(self.model, datamodule, roles, self.hparams.feature_cache,
                                shard_size=self.hparams.feature_cache_shard_size)
        fill_feature_caches(self.model, datamodule, caches, rank=self.trainer.global_rank,
                            world_size=self.trainer.world_size, device=self.device,
                            barrier=self.trainer.strategy.barrier, progress=self.trainer.is_global_zero)
        for role, cache in caches.items():
            datamodule.use_feature_cache(role, cache)
        self.model.encoder.cached_input = bool(caches)

    def teardown(self, stage: str) -> None:
        self.model.encoder.cached_input = False  # the model reads images again (caption, overlay)

    # ----------------------------------------------------------------------------------- plumbing
    def on_fit_start(self) -> None:
        """Save the vocabulary as plain JSON next to the checkpoints (it is inside them too, as a list)."""
        start, epochs = self.hparams.self_critical_from_epoch, self.trainer.max_epochs
        if start is not None and epochs is not None and 0 <= epochs <= start:
            log.warning("self_critical_from_epoch is %d but max_epochs is %d: training ends before any "
                        "self-critical epoch", start, epochs)
        if self.hparams.self_critical_from_time is not None:
            self._budget_used = self._time_budget_used()
        folder = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        vocab = getattr(self.trainer.datamodule, "vocab", None)  # the DataModule's knows its min_count
        if self.trainer.is_global_zero and folder:
            (vocab if vocab is not None and vocab.tokens == self.model.vocab.tokens else self.model.vocab).to_json(
                Path(folder) / "vocab.json")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint whose words differ from this run's vocabulary: its ids would mean other words."""
        super().on_load_checkpoint(checkpoint)
        self.model.vocab.require_same(checkpoint.get("hyper_parameters", {}).get("vocabulary"))

    def parameter_groups(self) -> list[dict[str, Any]]:
        """The optimiser's groups: the decoder with the training aids' heads (concept, object class and colour)
        at ``lr``, the encoder's trainable stages at ``encoder_lr`` (default ``lr``)."""
        aids = [p for head in (self.concept_head, self.object_head, self.object_colour_head) if head is not None
                for p in head.parameters()]
        groups = [{"params": list(self.model.decoder.parameters()) + aids, "lr": self.hparams.lr}]
        encoder_params = [p for p in self.model.encoder.parameters() if p.requires_grad]
        if encoder_params:
            groups.append({"params": encoder_params, "lr": self.hparams.encoder_lr or self.hparams.lr})
        return groups

    def configure_optimizers(self):  # noqa: ANN201 - Lightning's own return type
        optimizer = torch.optim.AdamW(self.parameter_groups(), lr=self.hparams.lr,
                                      weight_decay=self.hparams.weight_decay)
        return self.warmup_cosine(optimizer, warmup_epochs=self.hparams.warmup_epochs,
                                  by_time=self.hparams.schedule_by_time)


def feature_caches(model: Captioner, datamodule: Any, roles: Sequence[str], root: str | Path, *,
                   shard_size: int = 256) -> dict[str, FeatureCache]:
    """The feature cache of each ``role`` split's images under ``model``'s frozen encoder part: keyed by that
    part's weights, the image size, normalisation, grid pooling, resizing and the image files themselves. The
    part's output shape and weights digest are computed once for all the splits."""
    part = model.encoder.frozen_part()
    if part is None:
        raise ValueError("feature_cache needs a frozen encoder: set trainable_stages")
    device = next(model.parameters()).device
    was_training = part.training
    part.eval()
    with torch.no_grad():
        shape = tuple(part(torch.zeros(1, 3, datamodule.image_size, datamodule.image_size, device=device)).shape[1:])
    part.train(was_training)
    key = {
        "backbone": model.encoder.backbone_name, "frozen_stages": len(model.encoder.frozen_stages),
        "weights": tensors_digest(sorted(part.state_dict().items())), "image_size": datamodule.image_size,
        "resize": "squashed to the square, bicubic", "mean": list(datamodule.mean), "std": list(datamodule.std),
        "pooled_to": list(shape[-2:]),
    }
    caches = {}
    for role in roles:
        paths = [record.path for record in datamodule.records(role)]
        caches[role] = FeatureCache(root, {**key, "images": images_digest(paths)}, len(paths), shape,
                                    shard_size=shard_size)
    return caches


def fill_feature_caches(model: Captioner, datamodule: Any, caches: dict[str, FeatureCache], *, rank: int = 0,
                        world_size: int = 1, device: torch.device | str = "cpu",
                        barrier: Callable[[], None] | None = None, progress: bool = True) -> dict[str, FeatureCache]:
    """Fill (this rank's share of) each split's cache in ``caches`` (``feature_caches``) and return them, all
    complete."""
    from tqdm.auto import tqdm

    part = model.encoder.frozen_part()
    for role, cache in caches.items():
        todo = cache.missing(rank, world_size)
        if todo and progress:
            log.info("feature cache of the %s split (%d images, %.1f MB in all, %d KB per image): %s", role,
                     cache.count, cache.total_bytes / 1e6, cache.bytes_per_image // 1000, cache.folder)
        records = datamodule.records(role)
        policy = getattr(datamodule, "bad_image_options", {}).get("on_bad_image", "skip")

        def load(index: int, records: list = records, policy: str = policy) -> Tensor | None:
            path = records[index].path
            return load_or_skip(lambda: load_caption_image(path, datamodule.image_size), policy, None)

        def encode(images: Tensor) -> Tensor:
            return part(datamodule.normalize(images.to(device)))

        bar = tqdm(total=sum(len(cache.shard_rows(shard)) for shard in todo), desc=f"caching {role} features",
                   disable=not (todo and progress), unit="img")
        part.eval()
        with torch.no_grad():
            encoded = cache.fill(load, encode, batch_size=getattr(datamodule, "eval_batch_size", 64), rank=rank,
                                 world_size=world_size, progress=bar.update)
        bar.close()
        if todo:
            log.info("rank %d of %d filled %d shards (%d images) of the %s feature cache", rank, world_size,
                     len(todo), encoded, role)
        if barrier is not None:
            barrier()  # every rank's shards are in place
        if not cache.complete:
            raise RuntimeError(f"{cache.folder}: shards {cache.missing()[:5]} are still missing after the fill")
    model.encoder.train(model.encoder.training)  # frozen stages back to eval, the rest as they were
    return caches
