"""The captioner's attention scores (``attention_score``): each by its formula from the literature, the keys
computed once per image, multihead contexts and maps, and the heads reaching beams, records and overlays."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.decoder import ATTENTION_SCORES, AttentionDecoder, DecoderState
from vision_attn.captioning.extensions import ATTENTION_INPUTS
from vision_attn.captioning.product_attention import PRODUCT_SCORES, ProductAttention
from vision_attn.captioning.seams import built
from vision_attn.overlay import caption_overlay
from vision_attn.results import caption_record, record_problem

START, END = 1, 2


def scores(score: str, **options) -> ProductAttention:
    torch.manual_seed(0)
    attention = ATTENTION_SCORES[score](6, 4, 8, **options)
    for parameter in attention.parameters():  # away from the init's small values, so every term matters
        torch.nn.init.normal_(parameter, std=0.7)
    return attention


def test_each_product_score_is_its_formula() -> None:
    a, h = torch.randn(2, 5, 6), torch.randn(2, 4)  # annotations a_i (D 6), queries h (|h| 4)
    dot, general, scaled = scores("dot"), scores("general"), scores("scaled_dot")
    # dot (Luong): e_i = hᵀ (W_a a_i), W_a to the query's width
    e = torch.einsum("bq,blq->bl", h, dot.annotation_proj(a))
    torch.testing.assert_close(dot(dot.keys(a), h).alpha, e.softmax(-1))
    # general (Luong): e_i = hᵀ W a_i, with W (|h|, D) = the query projection's weight transposed
    w = general.query_proj.weight.T  # (4, 6)
    e = torch.einsum("bq,qd,bld->bl", h, w, a)
    torch.testing.assert_close(general(general.keys(a), h).alpha, e.softmax(-1))
    assert general.annotation_proj is None and general.query_proj.bias is None
    # scaled_dot (Vaswani): e_i = (W_q h)ᵀ (W_k a_i) / √d, d = 8
    e = torch.einsum("bd,bld->bl", scaled.query_proj(h), scaled.annotation_proj(a)) / 8**0.5
    torch.testing.assert_close(scaled(scaled.keys(a), h).alpha, e.softmax(-1))


def test_multihead_is_one_scaled_dot_per_slice() -> None:
    a, h = torch.randn(2, 5, 6), torch.randn(2, 4)
    multi = scores("multihead", heads=2)
    attended = multi(multi.keys(a), h)
    alpha = attended.heads
    assert alpha.shape == (2, 2, 5)
    torch.testing.assert_close(attended.alpha, alpha.mean(1))
    q, k = multi.query_proj(h).view(2, 2, 4), multi.annotation_proj(a).view(2, 5, 2, 4)
    for head in range(2):  # e^k_i = (W_q h)_kᵀ (W_k a_i)_k / √(d/K)
        e = torch.einsum("bd,bld->bl", q[:, head], k[:, :, head]) / 4**0.5
        torch.testing.assert_close(alpha[:, head], e.softmax(-1))
    with pytest.raises(ValueError, match="multiples of attention_heads"):
        ATTENTION_SCORES["multihead"](6, 4, 8, heads=3)
    with pytest.raises(ValueError, match="attention_score must be one of additive, dot"):
        AttentionDecoder(vocab_size=5, annotation_dim=6, attention_score="cosine")


def test_coverage_and_the_last_word_reach_every_product_score() -> None:
    """The attention inputs plug into every score through the same interface: their terms move α."""
    a, h, word = torch.randn(1, 5, 6), torch.randn(1, 4), torch.randn(1, 3)
    for score in PRODUCT_SCORES:
        attention = scores(score, heads=2)
        coverage, previous = built([{"name": "coverage"}, {"name": "previous_word"}], ATTENTION_INPUTS,
                                   widths=attention.widths, embed_dim=3).values()
        for parameter in [*coverage.parameters(), *previous.parameters()]:
            torch.nn.init.normal_(parameter, std=0.7)
        keys = attention.keys(a)
        alphas = [attention(keys, h, [previous.term(None, said)], [coverage.term(covered, None)]).alpha
                  for covered, said in ((torch.zeros(1, 5), word), (torch.eye(5)[:1] * 2, word),
                                        (torch.zeros(1, 5), -word))]
        assert not torch.allclose(alphas[0], alphas[1]), score
        assert not torch.allclose(alphas[0], alphas[2]), score


def decoder(score: str, **options) -> AttentionDecoder:
    torch.manual_seed(0)
    return AttentionDecoder(vocab_size=7, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=8,
                            dropout=0.0, attention_score=score, attention_heads=2, **options).eval()


@pytest.mark.parametrize("score", ATTENTION_SCORES)
def test_beams_share_the_keys_of_their_image(score: str) -> None:
    """The keys are computed once per image (``encode``) and read by all r beams of that image: the same α
    and context as r expanded copies of the image."""
    model = decoder(score)
    annotations, hidden, cell = torch.randn(3, 9, 8), torch.randn(12, 10), torch.randn(12, 10)
    state = DecoderState(hidden, cell)
    shared = model.context(model.encode(annotations), state)
    expanded = model.context(model.encode(annotations.repeat_interleave(4, dim=0)), state)
    torch.testing.assert_close(shared.context, expanded.context)
    torch.testing.assert_close(shared.alpha, expanded.alpha)
    assert (shared.heads is None) == (score != "multihead")


def test_multihead_context_reads_each_slice_with_its_own_alpha_and_alpha_is_the_mean() -> None:
    model = decoder("multihead")
    annotations = torch.randn(2, 9, 8)
    state = model.initial_state(annotations)
    attended = model.context(model.encode(annotations), state)
    heads = attended.heads  # (B, K, L)
    torch.testing.assert_close(attended.alpha, heads.mean(1))
    slices = annotations.view(2, 9, 2, 4)
    expected = torch.cat([torch.einsum("bl,bld->bd", heads[:, k], slices[:, :, k]) for k in range(2)], dim=1)
    beta = torch.sigmoid(model.gate(state.hidden))
    torch.testing.assert_close(attended.context, beta * expected)


def test_hard_attention_with_heads_takes_one_whole_annotation_vector() -> None:
    model = decoder("multihead", attention_mode="hard")
    annotations = torch.randn(2, 9, 8)
    image, state = model.encode(annotations), model.initial_state(annotations)
    attended = model.context(image, state)  # eval: the likeliest location of the mean α
    chosen = attended.alpha.argmax(1)
    beta = attended.beta.unsqueeze(1)
    torch.testing.assert_close(attended.context, beta * annotations[torch.arange(2), chosen])
    model.train()
    sampled = model.context(image, state, sample=True)
    torch.testing.assert_close(sampled.context, sampled.beta.unsqueeze(1) * annotations[torch.arange(2),
                                                                                        sampled.location])


def test_beam_heads_reach_the_record_and_the_overlay() -> None:
    model = decoder("multihead")
    beams = beam_search(model, torch.randn(1, 9, 8), start_id=START, end_id=END, beam_size=3, max_length=4,
                        min_length=3)
    best = beams[0][0]
    assert best.head_alphas.shape == (len(best.tokens), 2, 9)
    torch.testing.assert_close(best.head_alphas.mean(1), best.alphas)
    assert beam_search(decoder("dot"), torch.randn(1, 9, 8), start_id=START, end_id=END, beam_size=3,
                       max_length=4)[0][0].head_alphas is None
    words = [f"w{i}" for i in best.tokens]
    record = caption_record(7, words, best.alphas, best.betas, grid=(3, 3), image_size=(48, 48),
                            file_name="7.png", head_alphas=best.head_alphas)
    assert record_problem(record) is None and len(record["head_alphas"][0]) == 2
    image = Image.new("RGB", (48, 48), "gray")
    plain = caption_overlay(image, {k: v for k, v in record.items() if k != "head_alphas"}, panel_size=48)
    with_heads = caption_overlay(image, record, panel_size=48)
    assert with_heads.height > 2 * plain.height - 60  # a row of means, then one row per head
    bad = {**record, "head_alphas": record["head_alphas"][:-1]}
    assert "one list of K α rows per token" in record_problem(bad)
    assert "finite weights" in record_problem({**record, "head_alphas": [[[0.5]] * 2] * len(words)})
    with pytest.raises(ValueError, match="one list of K α rows per token"):
        caption_overlay(image, bad, panel_size=48)
