"""Reward terms of self-critical training, each added to a sample's CIDEr-D × its weight: the repeats (words said
more often than any reference says them) and the hallucinations (words no reference uses) come off, the share of
the consensus words (those every reference uses) said is added."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from vision_attn.captioning.seams import RewardTerm


def excess_words(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> int:
    """Σ_w max(0, c(w) − max(1, max_r c_r(w))): "a coat next to a bag and a bag" against references with two "a"s
    and one "bag" counts 2."""
    most: Counter = Counter()
    for reference in references:
        most |= Counter(reference)  # each word's largest count
    return sum(max(0, count - max(1, most[word])) for word, count in Counter(candidate).items())


def foreign_words(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> int:
    """Σ_w c(w) [w ∉ ∪_r r], 0 without references: on Fashion scenes, the words of an object that is not there (a
    hallucination, as CHAIR counts them, Rohrbach et al. 2018) or of phrasings no annotator chose."""
    if not references:
        return 0
    used = set().union(*map(set, references))
    return sum(1 for word in candidate if word not in used)


def consensus_recall(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
    """|C ∩ w| / |C| with C = ∩_r set(r), the words every reference uses (1.0 when none): on Fashion scenes each
    object's colour and class word, "a" and maybe "and"; on COCO, the words all five annotators chose."""
    if not references:
        return 1.0
    consensus = set(references[0]).intersection(*map(set, references[1:]))
    return len(consensus.intersection(candidate)) / len(consensus) if consensus else 1.0


class RepeatPenalty(RewardTerm):
    """− the words a sample uses more often than any reference does (``excess_words``)."""

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """−excess_words."""
        return -excess_words(candidate, references)


class HallucinationPenalty(RewardTerm):
    """− the words of a sample that no reference uses (``foreign_words``: an object that is not there)."""

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """−foreign_words."""
        return -foreign_words(candidate, references)


class RecallReward(RewardTerm):
    """+ the share of the words every reference uses that the sample uses (``consensus_recall``)."""

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """consensus_recall."""
        return consensus_recall(candidate, references)
