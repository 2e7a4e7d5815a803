"""The captioner's option groups (``option_groups`` says what a group is): the encoder, the decoder and its attention,
decoding, the objective, the training aids, self-critical training and the optimiser. ``CaptionerTask`` takes one of
each; ``Captioner`` (the network alone) the first three. Every option is in exactly one group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from vision_attn.attention import ATTENTION_SCORES
from vision_attn.option_groups import Optimiser, OptionGroup, at_most, finite, require

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
        """Refuse an unknown backbone, a width below 1, a stride other than 8 or 16, a grid below 1, or
        trainable_stages below -1."""
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
    coverage: bool = False
    """the attention also reads Σ_{s<t} α_s, what each location has been given so far"""
    attend_with_word: bool = False
    """the attention also reads E y_{t−1}, the word just said"""
    word_counts: bool = False
    """the output adds ρ ⊙ n_t, how often each word has been said, with ρ learnt per word"""
    word_count_context: bool = False
    """ρ_t = ρ + U h_t: whether a word may be said again depends on the state (needs word_counts)"""
    hard_expectation_prob: float = 0.5
    """hard attention: the share of training batches that use the expected context instead of a sample"""
    compile: str | None = None
    """fit, validate and test run the teacher-forced loop and the beam-search step through torch.compile in this
    mode on GPUs: default, reduce-overhead (CUDA graphs), max-autotune (null: eager; the same numbers either way;
    CPUs run eager)"""

    def check(self) -> None:
        """Refuse widths below 1, a dropout or β outside its range, an unknown attention mode, score or compile
        mode, and word_count_context without word_counts."""
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
        require(not self.word_count_context or self.word_counts, self.name,
                "word_count_context reads ρ from the state for the word counts: set word_counts: true")
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
    bad_endings: list[str] = field(default_factory=list)
    """words a caption may not end on ("and", "a"): beam search and self-critical sampling never put <end> right
    after one (self-critical training otherwise learns endings such as "... a red coat and" for the reward)"""
    revisit_penalty: float = 0.0
    """taken off the log-probability of each of ``object_words`` in beam search, × the largest overlap of this
    word's α with the α of an object word already said (Σ_i min(α_ti, α_si), 0 to 1): naming again the place already
    named costs up to this much, and two objects of one class in two places nothing (0: off)"""
    object_words: list[str] = field(default_factory=list)
    """the words that name objects, for ``revisit_penalty`` (the Fashion scenes: their ten class words)"""

    def check(self) -> None:
        """Refuse a beam size or maximum length below 1 or above its bound (50, 200), a negative length or
        revisit penalty, an empty or repeated bad ending or object word, or a revisit penalty without object
        words."""
        require(self.beam_size >= 1, self.name, f"beam_size must be at least 1, got {self.beam_size}")
        require(self.max_length >= 1, self.name, f"max_length must be at least 1, got {self.max_length}")
        at_most(self.name, "beam_size", self.beam_size, 50, "captions stop improving long before; each beam costs "
                                                            "time and memory")
        at_most(self.name, "max_length", self.max_length, 200, "no caption is that long; each word costs time, and "
                                                               "memory for its α")
        require(finite(self.length_penalty) and self.length_penalty >= 0, self.name,
                f"length_penalty must be 0 or more, got {self.length_penalty}")
        for option in ("bad_endings", "object_words"):
            words = getattr(self, option)
            require(all(isinstance(word, str) and word.strip() for word in words), self.name,
                    f"{option} are words, got {words}")
            require(len(set(words)) == len(words), self.name, f"{option} names a word twice: {words}")
        require(finite(self.revisit_penalty) and self.revisit_penalty >= 0, self.name,
                f"revisit_penalty must be 0 or more, got {self.revisit_penalty}")
        require(not self.revisit_penalty or self.object_words, self.name,
                "revisit_penalty needs object_words: the words that name objects")


@dataclass(frozen=True)
class ObjectiveOptions(OptionGroup):
    """The likelihood objective with the doubly stochastic term (eq. 14, ``likelihood.py``), and hard attention's
    REINFORCE with its moving-average baseline (eq. 12, ``reinforce.py``)."""

    name = "objective"

    doubly_stochastic_weight: float = 0.0
    """λ of λ Σ_i (1 − Σ_t α_ti)², which asks every location to be attended over the caption"""
    loss_normalisation: LossNormalisation = "paper"
    """paper: NLL summed over each caption and averaged over captions, the penalty averaged over locations (the
    authors' code); token: NLL per token, the penalty per caption"""
    reinforce_weight: float = 1.0
    """hard attention: the weight of REINFORCE's surrogate"""
    entropy_weight: float = 0.01
    """hard attention: λ_e of the entropy bonus that keeps the sampling exploratory"""
    baseline_decay: float = 0.9
    """hard attention: the moving average's decay, b ← decay·b + (1 − decay)·log p(y | s, a)"""

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
class TrainingAidsOptions(OptionGroup):
    """Losses that are not the paper's and that inference never runs (``aids.py``): they teach the annotation
    vectors what is where, and α where to look. Each is off at 0."""

    name = "aids"

    concept_weight: float = 0.0
    """the multiple-instance loss of the captions' words over the locations (Fang et al. 2015)"""
    object_weight: float = 0.0
    """each training object's class and colour from the annotation vectors under its box (needs the DataModule's
    object_targets)"""
    grounding_weight: float = 0.0
    """α on the box of the object each colour and class word names (Liu et al. 2017; needs object_targets)"""
    grounding_target: str = "box"
    """box: α's target is the share of the box's area in each cell; inside: that share times the share of the cell
    the box fills (cells the box only grazes, mostly background, get little)"""
    object_heads_from_encoder: bool = False
    """start the object heads from the encoder pretraining's class and colour heads (LP-FT; needs object_weight and
    an encoder pretraining checkpoint as encoder.pretrained)"""

    def check(self) -> None:
        """Refuse a negative weight, and object_heads_from_encoder without the object loss."""
        for key in ("concept_weight", "object_weight", "grounding_weight"):
            require(finite(getattr(self, key)) and getattr(self, key) >= 0, self.name,
                    f"{key} must be 0 or more, got {getattr(self, key)}")
        require(self.grounding_target in ("box", "inside"), self.name,
                f"grounding_target must be box or inside, got {self.grounding_target!r}")
        require(not self.object_heads_from_encoder or self.object_weight > 0, self.name,
                "object_heads_from_encoder needs the object loss: set object_weight above 0")


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
    repeat_penalty: float = 0.0
    """taken off the reward for every word a sample uses more often than any reference does"""
    hallucination_penalty: float = 0.0
    """taken off the reward for every word of a sample that no reference uses (an object that is not there)"""
    recall_reward: float = 0.0
    """added to the reward × the share of the words every reference uses that the sample uses"""

    def check(self) -> None:
        """Refuse a start outside the run, fewer than 2 samples when enabled, or a negative penalty or reward."""
        require(self.from_progress is None or (finite(self.from_progress) and 0 <= self.from_progress < 1),
                self.name, f"from_progress is a share of the run, from 0 to below 1, got {self.from_progress}")
        require(self.from_epoch is None or self.from_epoch >= 0, self.name,
                f"from_epoch must be an epoch number (0 or more), got {self.from_epoch}")
        require(not self.enabled or self.samples >= 2, self.name,
                f"samples must be at least 2 (the baseline is the mean reward of an image's other samples), got "
                f"{self.samples}")
        at_most(self.name, "samples", self.samples, 64, "each sample is a decoded caption per image per step")
        for key in ("repeat_penalty", "hallucination_penalty", "recall_reward"):
            require(finite(getattr(self, key)) and getattr(self, key) >= 0, self.name,
                    f"{key} must be 0 or more, got {getattr(self, key)}")

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
