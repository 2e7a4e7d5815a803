"""A captioner's checkpoint from before the extension lists, read today: its groups' flags and weights for what goes
beyond the paper become entries of today's lists (``seams.py``) and the extensions' weight names
(``checkpoint.upgrade`` applies both)."""

from __future__ import annotations

from typing import Any


def upgrade_extensions(hparams: dict[str, Any]) -> dict[str, Any]:
    """An older captioner's groups with today's lists, in place (today's are left as they are); the attention inputs
    keep the order their weights were made in (the additive score made the coverage's first)."""
    decoder, decoding = hparams.get("decoder"), hparams.get("decoding")
    if isinstance(decoder, dict) and "attention_inputs" not in decoder:
        flags = [("coverage", "coverage"), ("attend_with_word", "previous_word")]
        if decoder.get("attention_score", "additive") != "additive":
            flags.reverse()
        decoder["attention_inputs"] = [name for option, name in flags if decoder.pop(option, False)]  # flags as names
        context = decoder.pop("word_count_context", False)
        decoder["output_terms"] = [{"name": "word_counts", "context": context}] if decoder.pop("word_counts", False) \
            else []
    if isinstance(decoding, dict) and "processors" not in decoding:
        endings, penalty, words = (decoding.pop(key, default) for key, default in
                                   (("bad_endings", []), ("revisit_penalty", 0.0), ("object_words", [])))
        decoding["processors"] = ([{"name": "blocked_endings", "words": endings}] if endings else []) + \
            ([{"name": "revisit_penalty", "penalty": penalty, "words": words}] if penalty else [])
    aids = hparams.pop("aids", None)
    if isinstance(aids, dict):
        options = {"concept": {}, "object": {"heads_from_encoder": bool(aids.get("object_heads_from_encoder", False))},
                   "grounding": {"target": aids.get("grounding_target", "box")}}
        hparams.setdefault("objective", {})["auxiliary"] = [
            {"name": name, "weight": aids[f"{name}_weight"], **extra} for name, extra in options.items()
            if aids.get(f"{name}_weight")]
    critical = hparams.get("self_critical")
    if isinstance(critical, dict) and "rewards" not in critical:
        critical["rewards"] = [{"name": name, "weight": weight} for option, name in (
            ("repeat_penalty", "repeat"), ("hallucination_penalty", "hallucination"), ("recall_reward", "recall"))
            if (weight := critical.pop(option, 0.0))]
    return hparams


# A captioner's weights from before the extension lists, by prefix, under today's names
_EXTENSION_WEIGHTS = {"model.decoder.attention.coverage_proj.": "model.decoder.attention_inputs.coverage.proj.",
                      "model.decoder.attention.word_proj.": "model.decoder.attention_inputs.previous_word.proj.",
                      "model.decoder.repeat_weight": "model.decoder.output_terms.word_counts.weight",
                      "model.decoder.repeat_context.": "model.decoder.output_terms.word_counts.context.",
                      "aids.concept_head.": "auxiliary.concept.head.", "aids.object_head.": "auxiliary.object.head.",
                      "aids.object_colour_head.": "auxiliary.object.colour_head."}


def extension_weight_name(key: str) -> str:
    """A state-dict key under today's name (keys of today's checkpoints are left as they are)."""
    old = next((prefix for prefix in _EXTENSION_WEIGHTS if key.startswith(prefix)), None)
    return key if old is None else _EXTENSION_WEIGHTS[old] + key.removeprefix(old)
