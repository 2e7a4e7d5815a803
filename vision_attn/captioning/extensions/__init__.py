"""The registries of the captioner's extensions (``seams.py`` says what each seam is): a config lists an extension
by the name it is registered under here. Adding one is a new file beside these and one line in its registry."""

from __future__ import annotations

from vision_attn.captioning.extensions.blocked_endings import BlockedEndings
from vision_attn.captioning.extensions.concept import ConceptLoss
from vision_attn.captioning.extensions.coverage import Coverage
from vision_attn.captioning.extensions.forbidden_words import ForbiddenWords
from vision_attn.captioning.extensions.grounding import Grounding
from vision_attn.captioning.extensions.next_words import NextWords
from vision_attn.captioning.extensions.object_classes import ObjectClasses
from vision_attn.captioning.extensions.previous_word import PreviousWord
from vision_attn.captioning.extensions.revisit_penalty import RevisitPenalty
from vision_attn.captioning.extensions.reward_terms import HallucinationPenalty, RecallReward, RepeatPenalty
from vision_attn.captioning.extensions.word_counts import WordCounts

# decoder.attention_inputs: what the attention score reads besides h_{t−1}
ATTENTION_INPUTS = {"coverage": Coverage, "previous_word": PreviousWord}
# decoder.output_terms: learnt terms of the word scores
OUTPUT_TERMS = {"word_counts": WordCounts}
# decoding.processors: changes to each step's scores in beam search and self-critical sampling, in the listed order
PROCESSORS = {"blocked_endings": BlockedEndings, "revisit_penalty": RevisitPenalty, "forbidden_words": ForbiddenWords,
              "next_words": NextWords}
# objective.auxiliary: losses added to the training objective
AUXILIARY = {"concept": ConceptLoss, "object": ObjectClasses, "grounding": Grounding}
# self_critical.rewards: terms added to the self-critical reward
REWARDS = {"repeat": RepeatPenalty, "hallucination": HallucinationPenalty, "recall": RecallReward}
