"""Reward terms of self-critical training, each added to a sample's CIDEr-D × its weight: the repeats (words said
more often than any reference says them) and the hallucinations (words no reference uses) come off, the share of
the consensus words (those every reference uses) said is added."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from vision_attn.captioning.extensions.concept import WeightedOptions
from vision_attn.captioning.seams import RewardTerm


def excess_words(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> int:
    """How often the candidate repeats a word more than any reference does: Σ_w max(0, c(w) − max(1, max_r
    c_r(w))). A word used once never counts. "a coat next to a bag and a bag" against references with two "a"s
    and one "bag" each counts 2 (the third "a" and the second "bag")."""
    most: Counter = Counter()
    for reference in references:
        for word, count in Counter(reference).items():
            most[word] = max(most[word], count)
    return sum(max(0, count - max(1, most[word])) for word, count in Counter(candidate).items())


def foreign_words(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> int:
    """How many of the candidate's words no reference uses, each occurrence counted: Σ_w c(w) [w ∉ ∪_r r]. On
    Fashion scenes these are the colour and class words of an object that is not in the image (a hallucination,
    as CHAIR counts them: Rohrbach et al. 2018) and words of phrasings no annotator chose. "a red coat and a
    blue bag" against references naming a red coat alone counts 2 ("blue" and "bag"; "and" and "a" may be
    there). 0 when there are no references."""
    if not references:
        return 0
    used = set().union(*map(set, references))
    return sum(1 for word in candidate if word not in used)


def consensus_recall(candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
    """The fraction of the consensus words, those every reference uses, that the candidate uses: |C ∩ w| / |C|,
    C = ∩_r set(r). On Fashion scenes C holds each object's colour and class word (every caption names them
    all), and "a" (and "and" with three objects or more: a sample that ends on "and" earns it, which
    ``decoding.bad_endings`` forbids); on COCO, the words all five annotators chose. 1.0 when the references
    share no word."""
    if not references:
        return 1.0
    consensus = set(references[0]).intersection(*map(set, references[1:]))
    return len(consensus.intersection(candidate)) / len(consensus) if consensus else 1.0


class RepeatPenalty(RewardTerm):
    """− the words a sample uses more often than any reference does (``excess_words``)."""

    Options = WeightedOptions

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """−excess_words."""
        return -excess_words(candidate, references)


class HallucinationPenalty(RewardTerm):
    """− the words of a sample that no reference uses (``foreign_words``: an object that is not there)."""

    Options = WeightedOptions

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """−foreign_words."""
        return -foreign_words(candidate, references)


class RecallReward(RewardTerm):
    """+ the share of the words every reference uses that the sample uses (``consensus_recall``)."""

    Options = WeightedOptions

    def value(self, candidate: Sequence[int], references: Sequence[Sequence[int]]) -> float:
        """consensus_recall."""
        return consensus_recall(candidate, references)
