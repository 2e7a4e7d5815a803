"""The captioner's option groups (``option_groups``): encoder, decoder, decoding, objective, self-critical training
and optimiser, each option in one group; ``CaptionerTask`` takes them all, ``Captioner`` the first three. At their
defaults the captioner is the paper's; the groups' extension lists turn extensions on (``seams.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vision_attn.captioning.extensions import ATTENTION_INPUTS, AUXILIARY, OUTPUT_TERMS, PROCESSORS, REWARDS
from vision_attn.captioning.seams import Entry, checked_entries
from vision_attn.option_groups import Optimiser, OptionGroup, at_most, finite, require

ATTENTION_SCORES = ("additive", "dot", "general", "scaled_dot", "multihead")
BACKBONES = ("small", "vgg19", "resnet50", "resnet101", "vit")  # and timm:<model name>
LOSS_NORMALISATIONS = ("paper", "token")
AttentionMode = Literal["soft", "hard"]
LossNormalisation = Literal["paper", "token"]


@dataclass(frozen=True)
class EncoderOptions(OptionGroup):
    """The annotation-vector encoder (Xu et al. 2015, §3.1.1): a CNN or ViT trunk whose last feature map gives the
    annotation vectors a_1..a_L, one per grid cell."""

    name = "encoder"

    backbone: str = "small"
    """the trunk: small (a CPU-sized CNN), vgg19 (the paper's conv5_4), resnet50, resnet101, vit (this project's
    ViT, from `pretrained`) or timm:<model name>"""
    width: int = 32
    """the small CNN's base width (its annotation vectors have 8 × width dimensions)"""
    stride: int = 16
    """the small CNN's output stride, 8 or 16 (an S-pixel image gives an S/stride grid)"""
    grid_size: int | None = None
    """pool the feature map to this many cells per side (null: the trunk's own grid)"""
    pretrained: str | None = None
    """the trunk's first weights: a local file (an encoder pretraining or captioner checkpoint, a ViT checkpoint, a
    torchvision or timm state dict) or a name (imagenet, a torchvision enum member, a timm tag) found in the
    torchvision or Hugging Face cache; read when a fit starts, not when a checkpoint is restored"""
    trainable_stages: int = -1
    """fine-tune only the trunk's last N top-level stages (-1: all, 0: frozen)"""
    channels_last: bool = False
    """NHWC convolutions: the same maths, faster on CPUs and on GPUs' tensor cores"""
    vit: dict[str, Any] | None = None
    """the ViT trunk's architecture, read from `pretrained` when the encoder is built and kept in the checkpoint,
    which then rebuilds the ViT without that file (set by the encoder; leave it null)"""

    def check(self) -> None:
        """Refuse an unknown backbone, or a width, stride, grid or trainable_stages out of range."""
        require(self.backbone in BACKBONES or (self.backbone.startswith("timm:") and len(self.backbone) > 5),
                self.name, f"backbone: unknown backbone '{self.backbone}': use small, vgg19, resnet50, resnet101, "
                           "vit or timm:<name>")
        require(self.width >= 1, self.name, f"width must be at least 1, got {self.width}")
        require(self.stride in (8, 16), self.name, f"stride: the small CNN's output stride is 8 or 16, got "
                                                   f"{self.stride}")
        require(self.grid_size is None or self.grid_size >= 1, self.name,
                f"grid_size must be at least 1, got {self.grid_size}")
        at_most(self.name, "width", self.width, 1024, "the small CNN's annotation vectors would be 8 × that wide")
        at_most(self.name, "grid_size", self.grid_size, 64, "α over more cells than that costs memory per word")
        require(self.trainable_stages >= -1, self.name,
                f"trainable_stages must be -1 (all), 0 (frozen) or more, got {self.trainable_stages}")


COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


@dataclass(frozen=True)
class DecoderOptions(OptionGroup):
    """The LSTM decoder and its attention (Xu et al. 2015, §3.1.2 and §4): e_ti = f_att(a_i, h_{t−1}),
    α_t = softmax(e_t), z_t = β_t Σ_i α_ti a_i, and the deep output layer."""

    name = "decoder"

    embed_dim: int = 512
    """m, the word embedding's width"""
    hidden_dim: int = 512
    """n, the LSTM's width"""
    attention_dim: int = 512
    """the width of the attention's projections"""
    dropout: float = 0.5
    """dropout before the deep output's last projection"""
    attention_mode: AttentionMode = "soft"
    """soft (α's expectation, §4.2) or hard (one location s_t ~ α_t, trained with REINFORCE, §4.1)"""
    attention_score: str = "additive"
    """e_ti: additive (the paper's), dot, general, scaled_dot or multihead"""
    attention_heads: int = 4
    """heads of the multihead score"""
    gate: bool = True
    """β_t = σ(w_β·h_{t−1}) scales the context, z_t = β_t Σ_i α_ti a_i (§4.2.1); false: β_t = 1 (the ablation)"""
    initial_gate: float = 0.5
    """β's value at the start, strictly between 0 and 1 (an open gate reads words off the context early)"""
    hard_expectation_prob: float = 0.5
    """hard attention: the share of training batches that use the expected context instead of a sample"""
    compile: str | None = None
    """fit, validate and test run the teacher-forced loop and the beam-search step through torch.compile in this
    mode on GPUs: default, reduce-overhead (CUDA graphs), max-autotune (null: eager; the same numbers either way;
    CPUs run eager)"""
    attention_inputs: list[Entry] = field(default_factory=list)
    """what the attention score reads besides h_{t−1} (extensions, none in the paper): coverage (Σ_{s<t} α_s),
    previous_word (E y_{t−1})"""
    output_terms: list[Entry] = field(default_factory=list)
    """learnt terms of the word scores (extensions, none in the paper): word_counts (ρ ⊙ n_t; {name: word_counts,
    context: true} for ρ_t = ρ + U h_t)"""

    def __post_init__(self) -> None:  # the extension lists with every option filled in and checked
        for key, registry in (("attention_inputs", ATTENTION_INPUTS), ("output_terms", OUTPUT_TERMS)):
            object.__setattr__(self, key, checked_entries(getattr(self, key), registry, f"decoder.{key}"))

    def check(self) -> None:
        """Refuse widths out of range, a dropout or β outside its range, or an unknown mode or score."""
        for key in ("embed_dim", "hidden_dim", "attention_dim", "attention_heads"):
            require(getattr(self, key) >= 1, self.name, f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("embed_dim", "hidden_dim", "attention_dim"):
            at_most(self.name, key, getattr(self, key), 8192, "a wider layer only costs memory here")
        at_most(self.name, "attention_heads", self.attention_heads, 64, "each head costs memory per location")
        require(finite(self.dropout) and 0 <= self.dropout < 1, self.name,
                f"dropout must be from 0 to below 1, got {self.dropout}")
        require(self.attention_mode in ("soft", "hard"), self.name,
                f"attention_mode must be 'soft' or 'hard', got {self.attention_mode!r}")
        require(self.attention_score in ATTENTION_SCORES, self.name,
                f"attention_score must be one of {', '.join(ATTENTION_SCORES)}, got {self.attention_score!r}")
        require(finite(self.initial_gate) and 0.0 < self.initial_gate < 1.0, self.name,
                f"initial_gate is the starting β and must be strictly between 0 and 1, got {self.initial_gate}")
        require(finite(self.hard_expectation_prob) and 0 <= self.hard_expectation_prob <= 1, self.name,
                f"hard_expectation_prob must be from 0 to 1, got {self.hard_expectation_prob}")
        require(self.compile in COMPILE_MODES, self.name,
                f"compile must be null or one of {', '.join(map(str, COMPILE_MODES[1:]))}, got {self.compile!r}")


@dataclass(frozen=True)
class DecodingOptions(OptionGroup):
    """How captions are decoded in validation, test and `caption`: beam search (``beam_search.py``)."""

    name = "decoding"

    beam_size: int = 3
    """beams per image"""
    max_length: int = 20
    """the most words a caption has (also where training captions are cut)"""
    length_penalty: float = 0.0
    """a beam's score is its log-probability / length^penalty (0: none)"""
    processors: list[Entry] = field(default_factory=list)
    """changes to each step's word scores, applied in order (extensions, none in the paper): blocked_endings
    ({name: blocked_endings, words: [and, a]}: no caption ends on one), revisit_penalty ({name: revisit_penalty,
    penalty: 3.0, words: [...]}: naming again the place an object word already named costs up to the penalty),
    forbidden_words ({name: forbidden_words, words: [...]}: never said), next_words ({name: next_words, after:
    [blue], only: [coat, bag]}: after one of after comes one of only; listed again for each rule of word order)"""

    def __post_init__(self) -> None:  # the processors with every option filled in and checked
        object.__setattr__(self, "processors", checked_entries(self.processors, PROCESSORS, "decoding.processors",
                                                               repeatable=True))

    def check(self) -> None:
        """Refuse a beam size or maximum length out of range, or a negative length penalty."""
        require(self.beam_size >= 1, self.name, f"beam_size must be at least 1, got {self.beam_size}")
        require(self.max_length >= 1, self.name, f"max_length must be at least 1, got {self.max_length}")
        at_most(self.name, "beam_size", self.beam_size, 50, "captions stop improving long before; each beam costs "
                                                            "time and memory")
        at_most(self.name, "max_length", self.max_length, 200, "no caption is that long; each word costs time, and "
                                                               "memory for its α")
        require(finite(self.length_penalty) and self.length_penalty >= 0, self.name,
                f"length_penalty must be 0 or more, got {self.length_penalty}")


@dataclass(frozen=True)
class ObjectiveOptions(OptionGroup):
    """The likelihood objective with the doubly stochastic term (eq. 14, ``likelihood.py``), and hard attention's
    REINFORCE with its moving-average baseline (eq. 12, ``reinforce.py``)."""

    name = "objective"

    doubly_stochastic_weight: float = 1.0
    """λ of λ Σ_i (1 − Σ_t α_ti)², which asks every location to be attended over the caption (1, as the authors
    trained COCO; 0: off)"""
    loss_normalisation: LossNormalisation = "paper"
    """paper: NLL summed over each caption and averaged over captions, the penalty averaged over locations (the
    authors' code); token: NLL per token, the penalty per caption"""
    reinforce_weight: float = 1.0
    """hard attention: the weight of REINFORCE's surrogate"""
    entropy_weight: float = 0.01
    """hard attention: λ_e of the entropy bonus that keeps the sampling exploratory"""
    baseline_decay: float = 0.9
    """hard attention: the moving average's decay, b ← decay·b + (1 − decay)·log p(y | s, a)"""
    auxiliary: list[Entry] = field(default_factory=list)
    """losses added to the objective, that inference never runs (extensions, none in the paper), each {name, weight,
    ...}: concept (the captions' words over the locations), object (each object's class and colour under its box;
    heads_from_encoder), grounding (α on the box of the object a word names; target box or inside); object and
    grounding need the DataModule's object_targets"""

    def __post_init__(self) -> None:  # the auxiliary terms with every option filled in and checked
        object.__setattr__(self, "auxiliary", checked_entries(self.auxiliary, AUXILIARY, "objective.auxiliary"))

    def check(self) -> None:
        """Refuse a negative λ, an unknown normalisation, a baseline decay outside [0, 1), or non-finite weights."""
        require(finite(self.doubly_stochastic_weight) and self.doubly_stochastic_weight >= 0, self.name,
                f"doubly_stochastic_weight must be 0 or more, got {self.doubly_stochastic_weight}")
        require(self.loss_normalisation in LOSS_NORMALISATIONS, self.name,
                f"loss_normalisation must be one of {', '.join(LOSS_NORMALISATIONS)}, got "
                f"{self.loss_normalisation!r}")
        require(finite(self.baseline_decay) and 0 <= self.baseline_decay < 1, self.name,
                f"baseline_decay must be from 0 to below 1, got {self.baseline_decay}")
        for key in ("reinforce_weight", "entropy_weight"):
            require(finite(getattr(self, key)), self.name, f"{key} must be a finite number, got {getattr(self, key)}")


@dataclass(frozen=True)
class SelfCriticalOptions(OptionGroup):
    """Self-critical sequence training (Rennie et al. 2017; ``self_critical.py``): from a point of the run on,
    ``samples`` captions are drawn per image, each rewarded by its CIDEr-D against the image's references, and
    REINFORCE raises those that beat their siblings' mean. Needs the DataModule's group_captions: true."""

    name = "self_critical"

    from_epoch: int | None = None
    """switch to self-critical training at this epoch (null: never by epoch)"""
    from_progress: float | None = None
    """... or once this share of the run is done (of its steps, or of its time budget with schedule.by_time)"""
    samples: int = 5
    """captions sampled per image; the baseline of each is the mean reward of the others"""
    rewards: list[Entry] = field(default_factory=list)
    """terms added to each sample's CIDEr-D (extensions, none in Rennie et al.), each {name, weight}: repeat (off per
    word used more often than any reference uses it), hallucination (off per word no reference uses), recall (on ×
    the share of the words every reference uses that the sample says)"""

    def __post_init__(self) -> None:  # the reward terms with every option filled in and checked
        object.__setattr__(self, "rewards", checked_entries(self.rewards, REWARDS, "self_critical.rewards"))

    def check(self) -> None:
        """Refuse a start outside the run, or fewer than 2 samples when enabled."""
        require(self.from_progress is None or (finite(self.from_progress) and 0 <= self.from_progress < 1),
                self.name, f"from_progress is a share of the run, from 0 to below 1, got {self.from_progress}")
        require(self.from_epoch is None or self.from_epoch >= 0, self.name,
                f"from_epoch must be an epoch number (0 or more), got {self.from_epoch}")
        require(not self.enabled or self.samples >= 2, self.name,
                f"samples must be at least 2 (the baseline is the mean reward of an image's other samples), got "
                f"{self.samples}")
        at_most(self.name, "samples", self.samples, 64, "each sample is a decoded caption per image per step")

    @property
    def enabled(self) -> bool:
        """Whether self-critical training starts at some point of the run (by epoch or by progress)."""
        return self.from_epoch is not None or self.from_progress is not None


@dataclass(frozen=True)
class CaptionerOptimiser(Optimiser):
    """AdamW for the captioner: the decoder and the training aids' heads at ``lr``, the encoder's trainable stages
    at ``encoder_lr``."""

    encoder_lr: float | None = None
    """the learning rate of the encoder's trainable stages (null: lr)"""

    def check(self) -> None:
        """``Optimiser.check``, and refuse an encoder_lr not above 0."""
        super().check()
        require(self.encoder_lr is None or (finite(self.encoder_lr) and self.encoder_lr > 0), self.name,
                f"encoder_lr must be above 0, got {self.encoder_lr}")


@dataclass(frozen=True)
class ObjectNames(OptionGroup):
    """The classes and colours of the training objects, which the object loss predicts and the grounding loss
    finds in the captions; linked from the DataModule (``object_targets``). Empty without them."""

    name = "objects"

    classes: list[str] = field(default_factory=list)
    """the object classes, in the order of the training targets"""
    colours: list[str] = field(default_factory=list)
    """the object colours, in the order of the training targets"""
    class_words: list[list[str]] = field(default_factory=list)
    """the single words that name each class in captions, in the order of ``classes`` (from the DataModule's
    object-words table); empty: each class is named by its own name"""
