"""Show-Attend-Tell modules: shapes, the paper's quantities, beam search = exhaustive, hard-attention gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torchvision
from torch import nn

from vision_attn.captioning import fast_additive, fast_lstm
from vision_attn.captioning.beam_search import beam_search, greedy_decode, sample_captions
from vision_attn.captioning.decoder import AdditiveAttention, AttentionDecoder, DecoderState
from vision_attn.captioning.encoder import AnnotationEncoder
from vision_attn.captioning.extensions.concept import concept_loss, concept_targets
from vision_attn.captioning.extensions.reward_terms import consensus_recall, excess_words, foreign_words
from vision_attn.captioning.likelihood import caption_nll, doubly_stochastic_penalty
from vision_attn.captioning.options import SelfCriticalOptions
from vision_attn.captioning.reinforce import reinforce_surrogate
from vision_attn.captioning.self_critical import SelfCriticalObjective, self_critical_loss
from vision_attn.metrics import CiderD

PAD, START, END = 0, 1, 2


def tiny_decoder(vocab_size: int = 12, annotation_dim: int = 8, attention: str = "soft", coverage: bool = False,
                 attend_with_word: bool = False, word_counts: bool = False, attention_score: str = "additive",
                 attention_heads: int = 2, word_count_context: bool = False) -> AttentionDecoder:
    """A small decoder with the named extensions: the coverage and the previous word as attention inputs, the word
    counts (with their context) as an output term."""
    torch.manual_seed(0)
    inputs = [name for name, on in (("coverage", coverage), ("previous_word", attend_with_word)) if on]
    terms = [{"name": "word_counts", "context": word_count_context}] if word_counts else []
    decoder = AttentionDecoder(vocab_size=vocab_size, annotation_dim=annotation_dim, embed_dim=6, hidden_dim=10,
                               attention_dim=8 if attention_score == "multihead" else 7, dropout=0.0,
                               attention_mode=attention, attention_score=attention_score,
                               attention_heads=attention_heads, attention_inputs=inputs, output_terms=terms)
    if word_counts:  # ρ starts at 0; give it values, so that the counts change the words' scores
        nn.init.normal_(decoder.output_terms.word_counts.weight, std=2.0)
    if word_count_context:  # U too starts at 0
        nn.init.normal_(decoder.output_terms.word_counts.context.weight, std=1.0)
    return decoder


# The decoder's options that carry state from step to step: none (the paper), the attention's coverage, and
# coverage with the last word in the attention's query and the words' counts in the deep output
VARIANTS = [{}, {"coverage": True}, {"coverage": True, "attend_with_word": True, "word_counts": True}]
# ... and each of the other attention scores, with all of those options
VARIANTS += [{"attention_score": score, "coverage": True, "attend_with_word": True, "word_counts": True}
             for score in ("dot", "general", "scaled_dot", "multihead")]
# ... and ρ read from the state
VARIANTS += [{"attention_score": "scaled_dot", "coverage": True, "attend_with_word": True, "word_counts": True,
              "word_count_context": True}]


def captions_batch() -> torch.Tensor:
    return torch.tensor([[START, 5, 6, 7, END, PAD, PAD], [START, 8, END, PAD, PAD, PAD, PAD]])


def test_small_encoder_gives_a_grid_of_annotation_vectors() -> None:
    encoder = AnnotationEncoder(backbone="small", width=16)
    annotations, grid = encoder(torch.randn(2, 3, 96, 96))
    assert grid == (6, 6) and annotations.shape == (2, 36, 128)
    assert encoder.grid_for(96) == (6, 6)


def test_decoder_shapes_alpha_sums_to_one_and_beta_is_a_scalar_gate() -> None:
    decoder = tiny_decoder()
    output = decoder(torch.randn(2, 9, 8), captions_batch())
    assert output.logits.shape == (2, 6, 12)
    assert output.alphas.shape == (2, 6, 9)
    assert torch.allclose(output.alphas.sum(-1), torch.ones(2, 6), atol=1e-6)
    assert output.betas.shape == (2, 6)
    assert ((output.betas > 0) & (output.betas < 1)).all()


def test_initial_state_is_tanh_of_the_mean_annotation() -> None:
    decoder = tiny_decoder()
    annotations = torch.randn(3, 9, 8)
    state = decoder.initial_state(annotations)
    expected = torch.tanh(decoder.init_hidden(annotations.mean(1)))
    assert torch.allclose(state.hidden, expected)


@pytest.mark.parametrize("options", VARIANTS)
def test_teacher_forcing_equals_step_by_step_decoding(options: dict) -> None:
    coverage = options.get("coverage", False)
    decoder = tiny_decoder(**options).eval()
    annotations, captions = torch.randn(2, 9, 8), captions_batch()
    output = decoder(annotations, captions)
    image, state = decoder.encode(annotations), decoder.initial_state(annotations)
    for t in range(captions.shape[1] - 1):
        logits, alpha, beta, state, *_ = decoder.step(captions[:, t], image, state)
        assert torch.allclose(logits, output.logits[:, t], atol=1e-5)
        assert torch.allclose(alpha, output.alphas[:, t], atol=1e-6)
        assert torch.allclose(beta, output.betas[:, t], atol=1e-6)
        if coverage:  # c_{t+1} = Σ_{s<=t} α_s: each row has spent t + 1 units of attention
            assert torch.allclose(state.carried["coverage"], output.alphas[:, : t + 1].sum(1), atol=1e-6)
    assert ("coverage" in state.carried) == coverage


def test_coverage_changes_where_the_decoder_looks_and_is_trained() -> None:
    """With coverage the score reads Σ_{s<t} α_s through w_c: the same query attends differently once some
    locations are covered, and w_c receives a gradient."""
    decoder = tiny_decoder(coverage=True)
    coverage = decoder.attention_inputs.coverage
    nn.init.normal_(coverage.proj.weight, std=3.0)
    annotations = torch.randn(1, 9, 8)
    image, state = decoder.encode(annotations), decoder.initial_state(annotations)
    fresh = decoder.attention(image.keys, state.hidden, (), [coverage.term(state.carried["coverage"], None)]).alpha
    covered = decoder.attention(image.keys, state.hidden, (), [coverage.term(torch.eye(9)[:1] * 2.0, None)]).alpha
    assert not torch.allclose(fresh, covered)
    decoder(annotations, captions_batch()[:1]).logits.sum().backward()
    assert coverage.proj.weight.grad.abs().sum() > 0


def test_attention_reads_the_last_word_when_asked_and_learns_from_it() -> None:
    """e_ti = w·tanh(W_a a_i + W_h h + W_y E y_{t-1}): the same state attends differently after different words,
    W_y receives a gradient, and an attention built to read the word refuses to run without it."""
    decoder = tiny_decoder(coverage=True, attend_with_word=True)
    word_proj = decoder.attention_inputs.previous_word.proj
    nn.init.normal_(word_proj.weight, std=3.0)
    annotations = torch.randn(1, 9, 8)
    image, state = decoder.encode(annotations), decoder.initial_state(annotations)
    after = [decoder.context(image, state, decoder.embedding(torch.tensor([w]))).alpha for w in (5, 6)]
    assert not torch.allclose(after[0], after[1])
    keys = decoder.attention.annotation_proj(annotations)  # W_a a_i (``image.keys`` holds it doubled: fast form)
    x = keys.unsqueeze(1) + (decoder.attention.query_proj(state.hidden)  # coverage is 0 at the first step
                             + word_proj(decoder.embedding(torch.tensor([5])))).view(1, 1, 1, -1)
    expected = decoder.attention.score(torch.tanh(x)).squeeze(-1).view(1, 9).softmax(-1)
    torch.testing.assert_close(after[0], expected, atol=1e-6, rtol=1e-5)
    decoder(annotations, captions_batch()[:1]).logits.sum().backward()
    assert word_proj.weight.grad.abs().sum() > 0
    assert not len(tiny_decoder().attention_inputs)  # the paper's attention reads h_{t-1} only


def test_word_counts_add_rho_times_how_often_each_word_was_said() -> None:
    """p(y_t) ∝ exp(L_o(...) + ρ ⊙ n_t): the same step scores a word ρ_w lower (ρ_w < 0) for each time it was
    already said; teacher forcing counts the caption's words before each step; ρ learns from the likelihood."""
    plain, counted = tiny_decoder(), tiny_decoder(word_counts=True)
    counted.load_state_dict(plain.state_dict(), strict=False)  # the same weights but ρ
    annotations, captions = torch.randn(2, 9, 8), captions_batch()
    with torch.no_grad():
        difference = counted(annotations, captions).logits - plain(annotations, captions).logits  # ρ ⊙ n_t
    counts = torch.zeros(2, captions.shape[1] - 1, 12)
    for b in range(2):
        for t in range(captions.shape[1] - 1):
            for word in captions[b, : t + 1].tolist():  # the words input up to step t, <start> included
                counts[b, t, word] += 1
    rho = counted.output_terms.word_counts.weight
    torch.testing.assert_close(difference, rho.detach() * counts, atol=1e-5, rtol=1e-5)
    counted(annotations, captions).logits.log_softmax(-1)[:, 1:, 5].sum().backward()
    assert rho.grad[5] != 0  # word 5 was said at step 1: its ρ learns from then on
    assert not len(plain.output_terms)


def test_word_count_context_reads_rho_from_the_state_and_starts_as_the_plain_counts() -> None:
    """ρ_t = ρ + U h_t: with U = 0 (its start) the scores are word_counts' exactly; with U it adds (U h_t) ⊙ n_t,
    so that saying a word again can be likely after one context ("the red coat") and not after another."""
    counted = tiny_decoder(word_counts=True)
    fresh = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7,
                             dropout=0.0, output_terms=[{"name": "word_counts", "context": True}])
    fresh.load_state_dict(counted.state_dict(), strict=False)  # the same weights; U as constructed
    annotations, captions = torch.randn(2, 9, 8), captions_batch()
    term = fresh.output_terms.word_counts
    with torch.no_grad():
        torch.testing.assert_close(fresh(annotations, captions).logits, counted(annotations, captions).logits)
        nn.init.normal_(term.context.weight, std=1.0)
        hidden = torch.randn(3, 10)
        counts = torch.tensor([[0.0] * 5 + [2.0] + [0.0] * 6] * 3)  # word 5 said twice
        logits = torch.randn(3, 12)
        difference = term.step(logits, hidden, counts) - term.step(logits, hidden, torch.zeros_like(counts))
        rho = term.weight[5] + hidden @ term.context.weight[5] + term.context.bias[5]
        expected = 2.0 * rho
        torch.testing.assert_close(difference[:, 5], expected)
        assert difference[:, [i for i in range(12) if i != 5]].abs().max() == 0  # only the said word moves
    fresh.zero_grad()
    fresh(annotations, captions).logits.log_softmax(-1)[:, 1:, 5].sum().backward()
    assert term.context.weight.grad[5].abs().sum() > 0  # U learns from the likelihood, from U = 0


def test_doubly_stochastic_penalty_by_hand() -> None:
    alphas = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])  # (1, T=3, L=3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third step is padding
    # Σ_t α_ti over real steps = [0.5, 1.0, 0.5] -> Σ_i (1 − ·)² = 0.25 + 0 + 0.25
    assert torch.allclose(doubly_stochastic_penalty(alphas, mask), torch.tensor([0.5]))


def test_both_loss_normalisations_by_hand() -> None:
    from vision_attn.captioning.likelihood import likelihood_objective, token_likelihood

    # two captions, T = 3 steps, V = 4 words, L = 2 locations; the second caption has 2 real tokens
    logits = torch.log(torch.tensor([[[0.25, 0.25, 0.0, 0.5], [0.25, 0.0, 0.25, 0.5], [0.1, 0.1, 0.4, 0.4]],
                                     [[0.0, 0.5, 0.0, 0.5], [0.0, 0.25, 0.75, 0.0], [0.25, 0.25, 0.25, 0.25]]]) + 1e-30)
    captions = torch.tensor([[START, 3, 3, 2], [START, 3, 2, PAD]])  # <start>, then the targets (2 = <end>)
    alphas = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]], [[0.25, 0.75], [0.75, 0.25], [0.5, 0.5]]])
    likelihood = token_likelihood(logits, captions)
    # −log p: caption 1 = ln 2 + ln 2 + ln 2.5; caption 2 = ln 2 + ln(4/3); padding left out
    nll = torch.tensor([2 * math.log(2) + math.log(2.5), math.log(2) + math.log(4 / 3)])
    # Σ_t α over real steps: caption 1 [1.5, 1.5] -> (1 − ·)² = [0.25, 0.25]; caption 2 [1.0, 1.0] -> [0, 0]
    nll_paper, penalty_paper, scale_paper = likelihood_objective(likelihood, alphas, 1.0, "paper")
    assert torch.isclose(nll_paper, nll.sum() / 2)  # summed over each caption, averaged over captions
    assert torch.isclose(penalty_paper, torch.tensor((0.25 + 0.25) / 2 + 0.0))  # mean over L, sum over captions
    nll_token, penalty_token, scale_token = likelihood_objective(likelihood, alphas, 1.0, "token")
    assert torch.isclose(nll_token, nll.sum() / 5)  # 5 real tokens
    assert torch.isclose(penalty_token, torch.tensor((0.25 + 0.25 + 0.0) / 2))  # sum over L, mean over captions
    assert scale_paper == 2 and scale_token == 5  # what the hard-attention surrogate's caption sum is divided by
    assert likelihood_objective(likelihood, alphas, 0.0, "paper").penalty is None
    from vision_attn.captioning.options import ObjectiveOptions

    with pytest.raises(ValueError, match="objective.loss_normalisation must be one of paper, token"):
        ObjectiveOptions.coerce({"loss_normalisation": "sum"})


def test_padding_is_excluded_from_the_loss() -> None:
    logits = torch.randn(2, 4, 5)
    targets = torch.tensor([[3, 4, END, PAD], [3, END, PAD, PAD]])
    mask = (targets != PAD).float()
    changed = logits.clone()
    changed[0, 3] += 100.0
    changed[1, 2:] -= 50.0
    assert torch.allclose(caption_nll(logits, targets, mask), caption_nll(changed, targets, mask))
    manual = -logits[1].log_softmax(-1)[[0, 1], [3, END]].sum()
    assert torch.allclose(caption_nll(logits, targets, mask)[1], manual)


@torch.no_grad()
def _sequence_log_prob(decoder: AttentionDecoder, annotations: torch.Tensor, words: tuple[int, ...]) -> float:
    captions = torch.tensor([[START, *words, END]])
    logits = decoder(annotations, captions).logits.log_softmax(-1)[0]
    return float(logits[torch.arange(len(words) + 1), captions[0, 1:]].sum())


@pytest.mark.parametrize("options", VARIANTS)
def test_beam_search_equals_exhaustive_search_on_a_tiny_model(options: dict) -> None:
    """With coverage and word counts too: the beams' coverage and counts must be reordered with their hidden
    states; with the last word, each beam's own word must reach its attention."""
    vocab_size, max_length = 6, 3  # words 3, 4, 5 (3 plays <unk>); <pad> <start> are never emitted
    decoder = tiny_decoder(vocab_size=vocab_size, **options).eval()
    if options.get("coverage"):
        nn.init.normal_(decoder.attention_inputs.coverage.proj.weight, std=3.0)
    annotations = torch.randn(2, 9, 8)
    words = [3, 4, 5]
    candidates = [seq for n in range(max_length + 1) for seq in itertools.product(words, repeat=n)]
    # k = |words|^max_length keeps every prefix alive, so beam search must find the exhaustive optimum
    results = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=len(words) ** max_length,
                          max_length=max_length)
    for b in range(2):
        scored = sorted(((_sequence_log_prob(decoder, annotations[b : b + 1], c), c) for c in candidates),
                        reverse=True)
        best_score, best = scored[0]
        assert tuple(results[b][0].tokens) == best
        assert results[b][0].log_prob == pytest.approx(best_score, abs=1e-4)
        top5 = [tuple(h.tokens) for h in results[b][:5]]
        assert top5 == [c for _, c in scored[:5]]


def test_beam_returns_alpha_and_beta_per_emitted_word_and_respects_max_length() -> None:
    decoder = tiny_decoder().eval()
    annotations = torch.randn(3, 9, 8)
    for beams in beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=4, max_length=5):
        assert len(beams) == 4
        assert [h.score for h in beams] == sorted((h.score for h in beams), reverse=True)
        for h in beams:
            assert len(h.tokens) <= 5 and END not in h.tokens and START not in h.tokens and PAD not in h.tokens
            assert h.alphas.shape == (len(h.tokens), 9) and h.betas.shape == (len(h.tokens),)
            if h.tokens:
                assert torch.allclose(h.alphas.sum(-1), torch.ones(len(h.tokens)), atol=1e-5)


@pytest.mark.parametrize("options", VARIANTS)
def test_greedy_equals_beam_of_one_and_batched_equals_one_at_a_time(options: dict) -> None:
    decoder = tiny_decoder(**options).eval()
    annotations = torch.randn(4, 9, 8)
    greedy = greedy_decode(decoder, annotations, start_id=START, end_id=END, max_length=6)
    batched = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=3, max_length=6)
    for b in range(4):
        alone = beam_search(decoder, annotations[b : b + 1], start_id=START, end_id=END, beam_size=3, max_length=6)
        assert [h.tokens for h in alone[0]] == [h.tokens for h in batched[b]]
        step_by_step = []
        image, state = decoder.encode(annotations[b : b + 1]), decoder.initial_state(annotations[b : b + 1])
        word = torch.tensor([START])
        for _ in range(6):
            logits, _, _, state, *_ = decoder.step(word, image, state)
            logits[:, [START, PAD]] = float("-inf")
            word = logits.argmax(-1)
            if word.item() == END:
                break
            step_by_step.append(word.item())
        assert greedy[b].tokens == step_by_step


def test_beams_attending_one_copy_of_the_annotations_equal_expanded_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = tiny_decoder().eval()
    annotations, hidden, cell = torch.randn(3, 9, 8), torch.randn(3 * 4, 10), torch.randn(3 * 4, 10)
    state = DecoderState(hidden, cell)
    word = torch.randn(12, 6)
    shared = decoder.context(decoder.encode(annotations), state, word)
    expanded = decoder.context(decoder.encode(annotations.repeat_interleave(4, dim=0)), state, word)
    for ours, reference in zip(shared[:3], expanded[:3], strict=True):
        assert torch.allclose(ours, reference, atol=1e-6)
    monkeypatch.setattr(fast_additive, "CHUNK_ELEMENTS", 2 * 4 * 9 * 7)  # chunks of 2 images, then 1, one buffer
    with torch.no_grad():  # chunking is for decoding; training keeps one piece
        assert torch.allclose(decoder.context(decoder.encode(annotations), state, word)[1], expanded[1], atol=1e-6)
    with pytest.raises(ValueError, match="5 queries for 3 images"):
        decoder.attention(decoder.encode(annotations).keys, torch.randn(5, 10))


def test_additive_attention_is_softmax_of_w_tanh_by_the_formula_with_its_gradients() -> None:
    """The paper's score as it reads, e_i = w·tanh(W_a a_i + W_h h) + b, and as ``fast_additive`` computes it."""
    torch.manual_seed(0)
    attention = AdditiveAttention(16, 10, 12)
    annotations, query = torch.randn(3, 9, 16), torch.randn(6, 10, requires_grad=True)  # 2 queries per image
    projected = attention.annotation_proj(annotations)  # W_a a_i (``keys`` gives it doubled, for the fast form)
    alpha = attention(attention.keys(annotations), query).alpha
    as_written = fast_additive.additive_scores_as_written(
        projected.unsqueeze(1), attention.query_proj(query).view(3, 2, 1, 12), attention.score).view(6, 9)
    torch.testing.assert_close(alpha, as_written.softmax(-1), atol=1e-6, rtol=1e-5)
    w, b = attention.score.weight[0], attention.score.bias
    energies = torch.tanh(projected.repeat_interleave(2, dim=0) + attention.query_proj(query)[:, None]) @ w + b
    expected = energies.softmax(dim=-1)  # α_i = softmax_i(w·tanh(W_a a_i + W_h h) + b), (6, 9)
    assert torch.allclose(alpha, expected, atol=1e-6)
    target = torch.randn(6, 9)
    ours = torch.autograd.grad((alpha * target).sum(), [query, attention.score.weight])
    reference = torch.autograd.grad((expected * target).sum(), [query, attention.score.weight])
    for got, want in zip(ours, reference, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_captions_of_one_image_share_its_annotations_in_teacher_forcing() -> None:
    decoder = tiny_decoder()
    annotations = torch.randn(2, 9, 8)
    captions = torch.cat([captions_batch(), captions_batch().flip(0)])[[0, 1, 2, 3]]  # 2 captions per image
    shared = decoder(annotations, captions)
    copied = decoder(annotations.repeat_interleave(2, dim=0), captions)
    assert torch.allclose(shared.logits, copied.logits, atol=1e-5)
    assert torch.allclose(shared.alphas, copied.alphas, atol=1e-6)
    with pytest.raises(ValueError, match="3 captions for 2 images"):
        decoder(annotations, captions[:3])


def test_min_length_forbids_end_until_then() -> None:
    decoder = tiny_decoder().eval()
    with torch.no_grad():
        decoder.output_words.bias[END] = 50.0  # <end> would win at every step
    annotations = torch.randn(2, 9, 8)
    early = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=3, max_length=6)
    assert all(len(beams[0].tokens) == 0 for beams in early)
    forced = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=3, max_length=6, min_length=4)
    assert all(len(h.tokens) >= 4 for beams in forced for h in beams)
    with pytest.raises(ValueError, match="min_length"):
        beam_search(decoder, annotations, start_id=START, end_id=END, max_length=6, min_length=7)


def test_length_penalty_prefers_longer_captions_than_raw_log_probability() -> None:
    decoder = tiny_decoder().eval()
    annotations = torch.randn(6, 9, 8)
    raw = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=5, max_length=8)
    normalised = beam_search(decoder, annotations, start_id=START, end_id=END, beam_size=5, max_length=8,
                             length_penalty=1.0)
    raw_lengths = sum(len(beams[0].tokens) for beams in raw)
    assert sum(len(beams[0].tokens) for beams in normalised) >= raw_lengths
    for beams in normalised:
        assert beams[0].score == pytest.approx(beams[0].log_prob / (len(beams[0].tokens) + 1), abs=1e-5)


def test_hard_attention_samples_one_location_and_gradients_flow() -> None:
    decoder = tiny_decoder(attention="hard").train()
    decoder.hard_expectation_prob = 0.0
    annotations = torch.randn(2, 9, 8, requires_grad=True)
    captions = captions_batch()
    output = decoder(annotations, captions)
    assert output.location_log_probs is not None and output.location_log_probs.shape == (2, 6)
    mask = (captions[:, 1:] != PAD).float()
    nll = caption_nll(output.logits, captions[:, 1:], mask)
    surrogate = reinforce_surrogate(-nll, output.location_log_probs, output.location_entropy, mask, baseline=-5.0)
    (nll.mean() - surrogate.mean()).backward()
    for name in ("attention.annotation_proj.weight", "attention.query_proj.weight", "attention.score.weight",
                 "lstm.weight_ih", "output_words.weight"):
        gradient = dict(decoder.named_parameters())[name].grad
        assert gradient is not None and gradient.abs().sum() > 0, name
    # the context of a hard step is exactly one annotation vector, scaled by β
    decoder.eval()
    image, state = decoder.encode(annotations.detach()), decoder.initial_state(annotations.detach())
    context, alpha, beta, *_ = decoder.context(image, state)
    chosen = annotations.detach()[torch.arange(2), alpha.argmax(1)]
    assert torch.allclose(context, beta[:, None] * chosen, atol=1e-6)


def test_vgg19_and_resnet_encoders_match_the_paper_grids(tmp_path) -> None:
    vgg = AnnotationEncoder(backbone="vgg19").eval()
    with torch.no_grad():
        annotations, grid = vgg(torch.randn(1, 3, 224, 224))
    assert grid == (14, 14) and annotations.shape == (1, 196, 512)
    convs = [layer for layer in vgg.trunk if isinstance(layer, torch.nn.Conv2d)]
    assert len(convs) == 16 and all(not conv.bias.any() for conv in convs)  # conv1_1 .. conv5_4
    for conv in convs:  # as torchvision initialises VGG: He normal over the fan-out, zero biases
        fan_out = conv.out_channels * conv.kernel_size[0] * conv.kernel_size[1]
        assert conv.weight.std().item() == pytest.approx((2 / fan_out) ** 0.5, rel=0.1)
    resnet = AnnotationEncoder(backbone="resnet50", grid_size=14)
    assert resnet.annotation_dim == 2048 and resnet.grid_for(224) == (14, 14)


def test_encoder_loads_local_torchvision_weights_and_freezes_stages(tmp_path) -> None:
    source = torchvision.models.resnet50(weights=None)
    torch.save(source.state_dict(), tmp_path / "resnet50.pth")
    encoder = AnnotationEncoder(backbone="resnet50", pretrained=tmp_path / "resnet50.pth", trainable_stages=1)
    assert torch.equal(encoder.trunk[4][0].conv1.weight, source.layer4[0].conv1.weight)
    assert torch.equal(encoder.trunk[0][0].weight, source.conv1.weight)
    trainable = {name.split(".")[1] for name, p in encoder.named_parameters() if p.requires_grad}
    assert trainable == {"4"}  # only layer4 fine-tunes
    encoder.train()
    assert not encoder.trunk[0][1].training and encoder.trunk[4].training  # frozen BN keeps its statistics


def test_timm_backbone_through_features_only() -> None:
    encoder = AnnotationEncoder(backbone="timm:resnet18", grid_size=7)
    annotations, grid = encoder(torch.randn(1, 3, 96, 96))
    assert grid == (7, 7) and annotations.shape == (1, 49, 512)


def test_unknown_backbone_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown backbone 'vgg16'"):
        AnnotationEncoder(backbone="vgg16")


def test_without_the_gate_beta_is_one_and_the_context_is_the_expectation() -> None:
    """``decoder.gate: false``, the ablation of §4.2.1's gating scalar: no w_β, β_t = 1, z_t = Σ_i α_ti a_i."""
    decoder = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7,
                               gate=False).eval()
    assert decoder.gate is None and "gate.weight" not in decoder.state_dict()
    annotations = torch.randn(2, 9, 8)
    output = decoder(annotations, captions_batch())
    assert torch.equal(output.betas, torch.ones(2, 6))
    state = decoder.initial_state(annotations)
    attended = decoder.context(decoder.encode(annotations), state)
    torch.testing.assert_close(attended.context, torch.einsum("bl,bld->bd", attended.alpha, annotations))
    gated = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7)
    assert "gate.weight" in gated.state_dict()  # the paper's gate is the default


def test_initial_gate_sets_the_starting_beta_and_is_checked() -> None:
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size=12, annotation_dim=8, embed_dim=6, hidden_dim=10, attention_dim=7,
                               initial_gate=0.95)
    assert torch.sigmoid(decoder.gate.bias).item() == pytest.approx(0.95)
    betas = decoder(torch.randn(4, 9, 8), captions_batch().repeat(2, 1)).betas
    assert betas.mean() > 0.85  # w_β·h is small at initialisation, so β starts near the bias
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        AttentionDecoder(vocab_size=12, annotation_dim=8, initial_gate=1.0)


def test_sampled_captions_follow_the_decoders_distribution_and_its_log_probabilities() -> None:
    decoder = tiny_decoder().eval()
    annotations = torch.randn(2, 5, 8)
    torch.manual_seed(1)
    sampled = sample_captions(decoder, annotations, per_image=3000, start_id=START, end_id=END, pad_id=PAD,
                              max_length=4)
    tokens, mask = sampled.tokens, sampled.mask
    assert tokens.shape[0] == 6000 and tokens.shape[1] <= 5
    assert not ((tokens == START) | ((tokens == PAD) & (mask > 0))).any()  # <start>, <pad> never drawn
    ended = (tokens == END).cumsum(1)
    assert torch.equal(mask, ((ended - (tokens == END).long()) == 0).float())  # mask: words up to the first <end>
    assert torch.equal(tokens[mask == 0], torch.full_like(tokens[mask == 0], PAD))
    assert bool(((tokens == END) & (mask > 0)).sum(1).eq(1).all())  # every caption ends, by max_length at most
    # The first word's frequencies are p(y_1 | a) renormalised without <start> and <pad>, per image
    with torch.no_grad():
        image, state = decoder.encode(annotations), decoder.initial_state(annotations)
        logits, *_ = decoder.step(torch.full((2,), START), image, state)
        logits[:, [START, PAD]] = float("-inf")
        expected = logits.softmax(-1)
    observed = torch.stack([torch.bincount(tokens[i * 3000:(i + 1) * 3000, 0], minlength=12) / 3000 for i in range(2)])
    assert torch.allclose(observed, expected, atol=0.03)
    # The kept log-probabilities are the teacher-forced ones of the drawn words (same policy, same graph)
    rows = torch.arange(0, 6000, 500)
    forced = decoder(annotations[rows // 3000], torch.cat([torch.full((len(rows), 1), START), tokens[rows]], 1))
    forced_logits = forced.logits.clone()
    forced_logits[..., [START, PAD]] = float("-inf")
    teacher = forced_logits.log_softmax(-1).gather(2, tokens[rows].unsqueeze(-1)).squeeze(-1)
    teacher = teacher.masked_fill(mask[rows] == 0, 0.0)  # <pad> after <end> counts nothing
    last = mask[rows].sum(1).long() - 1  # where the caption ended: forced at max_length, so log p = 0 there
    at_limit = last == 4
    teacher[at_limit, 4] = 0.0
    assert torch.allclose(sampled.log_probs[rows], teacher, atol=1e-5)


def test_self_critical_baseline_is_the_mean_reward_of_the_other_samples() -> None:
    log_probs = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-0.5, -0.5], [-3.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    loss = self_critical_loss(log_probs, mask, rewards, per_image=4)
    advantages = torch.tensor([1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2])
    assert torch.allclose(loss, -advantages * torch.tensor([-2.0, -2.0, -1.0, -4.0]))
    loss.sum().backward()
    assert torch.allclose(log_probs.grad, -advantages[:, None] * mask)  # padding gets no gradient
    with pytest.raises(ValueError, match="at least 2 samples"):
        self_critical_loss(log_probs, mask, rewards, per_image=1)


def test_self_critical_training_learns_the_rewarded_caption() -> None:
    decoder = tiny_decoder()
    annotations = torch.randn(4, 5, 8)
    target = [5, 6, 7]
    reward = CiderD([[target], [[8, 9]], [[10, 11, 9]], [[4, 3, 8]]])  # the target's n-grams are rare: high idf
    start = greedy_decode(decoder, annotations, start_id=START, end_id=END, pad_id=PAD, max_length=6)
    assert any(h.tokens != target for h in start)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=0.03)
    torch.manual_seed(0)
    for _ in range(150):
        sampled = sample_captions(decoder, annotations, per_image=6, start_id=START, end_id=END, pad_id=PAD,
                                  max_length=6)
        candidates = [[w for w in row if w not in (END, PAD)] for row in sampled.tokens.tolist()]
        rewards = torch.tensor(reward(candidates, [[target]] * len(candidates)))
        loss = self_critical_loss(sampled.log_probs, sampled.mask, rewards, per_image=6).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    learnt = greedy_decode(decoder, annotations, start_id=START, end_id=END, pad_id=PAD, max_length=6)
    assert [h.tokens for h in learnt] == [target] * 4


def test_concept_targets_are_the_words_of_each_images_captions() -> None:
    captions = torch.tensor([[START, 5, 6, END, PAD], [START, 7, END, PAD, PAD], [START, 8, 5, END, PAD]])
    ignore = torch.tensor([PAD, START, END])
    targets = concept_targets(captions, torch.tensor([0, 0, 1]), images=2, vocab_size=10, ignore=ignore)
    assert targets[0].nonzero().flatten().tolist() == [5, 6, 7]
    assert targets[1].nonzero().flatten().tolist() == [5, 8]


def test_concept_loss_is_the_noisy_or_of_the_locations() -> None:
    """p_w = 1 − Π_i (1 − σ(s_iw)), by hand on 2 locations; a map that lights one location for each present word
    and none for absent words scores far better than one that lights every word everywhere."""
    ignore = torch.tensor([0])
    logits = torch.tensor([[[0.0, 1.0, -2.0], [0.0, -1.0, 0.5]]])  # (B=1, L=2, V=3)
    targets = torch.tensor([[0.0, 1.0, 0.0]])
    p1 = 1 - (1 - torch.sigmoid(torch.tensor(1.0))) * (1 - torch.sigmoid(torch.tensor(-1.0)))
    p2 = 1 - (1 - torch.sigmoid(torch.tensor(-2.0))) * (1 - torch.sigmoid(torch.tensor(0.5)))
    expected = -(torch.log(p1) + torch.log(1 - p2)) / 2  # word 0 is ignored
    assert torch.allclose(concept_loss(logits, targets, ignore), expected, atol=1e-6)
    right = torch.full((1, 4, 3), -8.0)
    right[0, 2, 1] = 8.0  # word 1 at location 2 only
    everywhere = torch.full((1, 4, 3), 8.0)
    assert concept_loss(right, targets, ignore) < 0.01 < 5 < concept_loss(everywhere, targets, ignore)


def test_consensus_recall_is_the_share_of_the_words_every_reference_uses() -> None:
    red, coat, white, bag, blue, top, a, next_to, left_of, there_is, and_ = range(5, 16)
    references = [[a, red, coat, next_to, a, white, bag, and_, a, blue, top],
                  [there_is, a, white, bag, left_of, a, red, coat, left_of, a, blue, top]]
    # every reference uses a, red, coat, white, bag, blue, top: 7 consensus words
    assert consensus_recall([a, red, coat, next_to, a, white, bag, and_, a, blue, top], references) == 1.0
    assert consensus_recall([there_is, a, red, coat, and_, a, white, bag], references) == 5 / 7  # the top left out
    assert consensus_recall([a, red, bag], references) == 3 / 7
    assert consensus_recall([a, red, coat], [[next_to], [and_]]) == 1.0  # no word shared: nothing to credit
    assert consensus_recall([a], []) == 1.0


def test_excess_words_count_what_no_reference_repeats() -> None:
    coat, bag, a, next_to, and_ = 5, 6, 7, 8, 9
    references = [[a, coat, next_to, a, bag], [a, bag, next_to, a, coat]]
    assert excess_words([a, coat, next_to, a, bag], references) == 0
    assert excess_words([a, coat, next_to, a, bag, and_, a, bag], references) == 2  # a 3rd "a" and a 2nd "bag"
    assert excess_words([a, coat, next_to, a, bag, and_, a, bag], references + [[a, a, a, bag]]) == 1


def test_foreign_words_count_each_word_no_reference_uses() -> None:
    red, coat, white, bag, blue, top, a, next_to, and_ = range(5, 14)
    references = [[a, red, coat, next_to, a, white, bag], [a, white, bag, and_, a, red, coat]]
    assert foreign_words([a, red, coat, and_, a, white, bag], references) == 0  # "and" is in one reference
    assert foreign_words([a, red, coat, and_, a, blue, top], references) == 2  # an object that is not there
    assert foreign_words([a, blue, top, and_, a, blue, top], references) == 4  # each occurrence counts
    assert foreign_words([a, blue, top], []) == 0


def test_the_hallucination_penalty_comes_off_the_reward_per_foreign_word() -> None:
    """rewards() with hallucination_penalty p is CIDEr-D − p × foreign_words, and a caption naming an object that
    is not there then earns less than one that leaves it out."""
    red, coat, white, bag, blue, top, a, and_ = range(5, 13)
    references = [[a, red, coat, and_, a, white, bag]] * 2
    candidates = [[a, red, coat, and_, a, white, bag], [a, red, coat, and_, a, white, bag, and_, a, blue, top],
                  [a, red, coat]]
    scores = {}
    for penalty in (0.0, 1.5):
        objective = SelfCriticalObjective(SelfCriticalOptions(rewards=[{"name": "hallucination", "weight": penalty}]),
                                          vocab=None, max_length=20)
        objective.reward = CiderD([references, [[a, blue, top]], [[a, white, coat]]])
        scores[penalty] = objective.rewards(candidates, [references] * 3)
    assert [plain - penalised for plain, penalised in zip(scores[0.0], scores[1.5], strict=True)] == \
        pytest.approx([0.0, 3.0, 0.0])
    assert scores[0.0][1] > scores[0.0][2]  # CIDEr-D alone prefers the extra object to the missing one
    assert scores[1.5][1] < scores[1.5][2]  # the penalty reverses that
    with pytest.raises(ValueError, match="self_critical.rewards.hallucination: weight must be 0 or more"):
        SelfCriticalOptions(rewards=[{"name": "hallucination", "weight": -1.0}])


def test_a_channels_last_encoder_computes_what_the_default_layout_does():
    """``channels_last`` only changes how the trunk's tensors are laid out: the same weights give the same annotation
    vectors and gradients, and loading a state dict keeps the layout."""
    torch.manual_seed(0)
    plain = AnnotationEncoder(backbone="small", width=8)
    fast = AnnotationEncoder(backbone="small", width=8, channels_last=True)
    fast.load_state_dict(plain.state_dict())
    convolution = fast.trunk[0][0].weight
    assert convolution.is_contiguous(memory_format=torch.channels_last) and not convolution.is_contiguous()
    torch.testing.assert_close(convolution, plain.trunk[0][0].weight)
    images = torch.randn(3, 3, 64, 64)
    (ours, grid), (theirs, their_grid) = fast(images), plain(images)
    assert grid == their_grid == (4, 4) and ours.shape == theirs.shape == (3, 16, 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    ours.square().sum().backward()
    theirs.square().sum().backward()
    torch.testing.assert_close(fast.trunk[0][0].weight.grad, plain.trunk[0][0].weight.grad, rtol=1e-3, atol=1e-4)


def teacher_forced_with_gradients(decoder: AttentionDecoder, annotations: torch.Tensor,
                                  captions: torch.Tensor) -> list[torch.Tensor]:
    """Logits, α and the gradients of a loss over both, for the annotations and every parameter."""
    annotations = annotations.clone().requires_grad_()
    decoder.zero_grad()
    output = decoder(annotations, captions)
    (output.logits.square().mean() + output.alphas.square().sum()).backward()
    return [output.logits, output.alphas, annotations.grad, *(p.grad for p in decoder.parameters())]


@pytest.mark.parametrize("extensions", [{}, {"coverage": True, "attend_with_word": True}, {"attention": "hard"}])
def test_teacher_forced_lstm_is_the_lstm_cell_it_stands_for(monkeypatch: pytest.MonkeyPatch, extensions: dict) -> None:
    """The teacher-forced loop's faster LSTM (word products for all steps at once, one weight gradient over all
    steps) gives nn.LSTMCell's outputs and gradients within float rounding, and the steps' order is its only state."""
    annotations, captions, applies = torch.randn(2, 9, 8), captions_batch(), fast_lstm.applies
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(fast_lstm, "applies", lambda embedded, cell, fast=fast: fast)
        decoder = tiny_decoder(**extensions)
        decoder.hard_expectation_prob = 1.0  # hard attention: the expected context, so both runs draw nothing
        runs.append(teacher_forced_with_gradients(decoder, annotations, captions))
    assert all(tensor is not None for tensor in runs[0][:3])
    for name, fast, cell in zip(["logits", "alphas", "annotations"] + [n for n, _ in tiny_decoder().named_parameters()],
                                *runs, strict=False):
        if name != "attention.score.bias":  # softmax ignores the score's bias: its gradient is rounding alone
            torch.testing.assert_close(fast, cell, atol=1e-6, rtol=1e-5, msg=name)
    lstm = fast_lstm.TeacherForcedLSTM(tiny_decoder().lstm, torch.randn(3, 4, 6))
    state = (torch.zeros(3, 10), torch.zeros(3, 10))
    for _ in range(4):
        state = lstm.step(torch.randn(3, 8), state)
    with pytest.raises(IndexError):  # a fifth step has no word: the loop is the caption's length
        lstm.step(torch.randn(3, 8), state)
    words = torch.randn(2, 3, 512)
    assert applies(words, nn.LSTMCell(512 + 512, 512))  # the paper's COCO widths
    assert not applies(words, nn.LSTMCell(512 + 64, 64))  # a small weight: the cell is faster
    assert not applies(words.to("meta"), nn.LSTMCell(512 + 512, 512))  # CPU tensors only


def test_teacher_forced_lstm_trains_under_bf16_autocast_as_the_cell_does(monkeypatch: pytest.MonkeyPatch) -> None:
    annotations, captions = torch.randn(2, 9, 8), captions_batch()
    runs = []
    for fast in (True, False):
        monkeypatch.setattr(fast_lstm, "applies", lambda embedded, cell, fast=fast: fast)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(teacher_forced_with_gradients(tiny_decoder(), annotations, captions))
    assert runs[0][3].dtype == torch.float32  # a parameter's gradient, in the parameter's dtype
    for fast, cell in zip(runs[0][:3], runs[1][:3], strict=True):  # bf16 products: close, not equal
        torch.testing.assert_close(fast.float(), cell.float(), atol=0.05, rtol=0.05)


def test_caption_nll_is_the_negative_log_softmax_of_each_real_token() -> None:
    logits, targets = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    mask = (torch.rand(3, 5) > 0.3).float()
    expected = -(logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask).sum(1)
    torch.testing.assert_close(caption_nll(logits, targets, mask), expected)
    torch.testing.assert_close(caption_nll(logits.transpose(0, 1).contiguous().transpose(0, 1), targets, mask),
                               expected)  # logits not laid out row by row
