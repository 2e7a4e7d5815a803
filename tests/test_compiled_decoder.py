"""decoder.compile: the teacher-forced loop and the beam-search step through torch.compile give the eager numbers
(forward, gradients, beam search) on captions of varying length, and the task compiles only what it runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from vision_attn.captioning.beam_search import beam_search
from vision_attn.captioning.compiled import compile_decoder
from vision_attn.captioning.decoder import AttentionDecoder
from vision_attn.captioning.options import DecoderOptions
from vision_attn.data.vocabulary import END_ID, START_ID

VOCAB, DIM = 23, 12


def decoders(backend: str = "inductor") -> tuple[AttentionDecoder, AttentionDecoder]:
    torch.manual_seed(0)
    eager = AttentionDecoder(vocab_size=VOCAB, annotation_dim=DIM, embed_dim=8, hidden_dim=16, attention_dim=8,
                             dropout=0.0, attention_inputs=["coverage", "previous_word"],
                             output_terms=[{"name": "word_counts", "context": True}])
    with torch.no_grad():  # ρ and U start at 0: give them values, so that the word counts' path is compared too
        eager.output_terms.word_counts.weight.normal_(0, 0.1)
        eager.output_terms.word_counts.context.weight.normal_(0, 0.1)
    compiled = copy.deepcopy(eager)
    compile_decoder(compiled, "default", backend=backend)
    return eager, compiled


def captions(batch: int, length: int) -> torch.Tensor:
    words = torch.randint(4, VOCAB, (batch, length + 2))
    words[:, 0], words[:, -1] = START_ID, END_ID
    return words


def test_the_compiled_decoder_gives_the_eager_outputs_and_gradients_for_any_caption_length() -> None:
    """The graph dynamo captures (the T-step loop, the state dataclasses), with autograd through it: aot_eager
    runs that graph as it is, in seconds; inductor's code for it is checked by the beam search below."""
    eager, compiled = decoders("aot_eager")
    annotations = torch.randn(2, 9, DIM)
    for length in (2, 3):  # a second length: compiled again (or run dynamically), never reused wrongly
        batch = captions(4, length)  # two captions per image
        outputs = [model(annotations, batch) for model in (eager, compiled)]
        torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(outputs[1].alphas, outputs[0].alphas, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(outputs[1].betas, outputs[0].betas, rtol=1e-4, atol=1e-5)
        for model, output in zip((eager, compiled), outputs, strict=True):
            model.zero_grad()
            (output.logits.logsumexp(-1).sum() + output.alphas.square().sum()).backward()
        for (name, theirs), ours in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_compiled_step_beam_searches_the_eager_captions_and_scores_them_the_same(backend, caplog) -> None:
    """Beam search with the compiled step, and the compiled teacher-forced loop scoring a caption, equal eager
    over batches of two sizes (one of them equal to L). aot_eager runs the captured graphs on the CPU; with
    inductor, whose CPU code for this decoder is wrong in torch 2.14.1, the CPU runs eager and says so once
    (scripts/compiled_decoder_check.py compares inductor's GPU code)."""
    eager, compiled = decoders(backend)
    eager.eval(), compiled.eval()
    for images, length in ((3, 4), (2, 5)):  # 3 images x 3 beams = 9 rows = L; then other sizes
        annotations = torch.randn(images, 9, DIM)
        with torch.no_grad():
            found = [beam_search(model, annotations, start_id=START_ID, end_id=END_ID, beam_size=3,
                                 max_length=length) for model in (eager, compiled)]
        for ours, theirs in zip(found[1], found[0], strict=True):
            assert [beam.tokens for beam in ours] == [beam.tokens for beam in theirs]
            torch.testing.assert_close(ours[0].alphas, theirs[0].alphas, rtol=1e-4, atol=1e-5)
            assert abs(float(ours[0].log_prob) - float(theirs[0].log_prob)) < 1e-4
        with torch.no_grad():
            batch = captions(images, length - 1)
            scored = [model(annotations, batch).logits for model in (eager, compiled)]
        torch.testing.assert_close(scored[1], scored[0], rtol=1e-4, atol=1e-5)
    said = [record for record in caplog.records if "runs eager on the CPU" in record.getMessage()]
    if backend == "inductor":  # said here, or earlier in this process: once only
        assert len(said) == 1 or (not said and _said_before())
    else:
        assert not said


def _said_before() -> bool:
    """Whether this process already gave the once-only CPU notice (another test compiled with inductor first)."""
    from vision_attn.captioning.compiled import _say_eager_on_cpu

    return _say_eager_on_cpu.cache_info().currsize > 0


def test_compile_keeps_the_state_dict_and_the_task_compiles_only_for_fit_validate_and_test() -> None:
    from vision_attn.tasks import CaptionerTask

    eager, compiled = decoders()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "bag"]
    task = CaptionerTask(vocabulary=words, encoder={"width": 4}, decoder={"embed_dim": 8, "hidden_dim": 8,
                                                                          "attention_dim": 8, "compile": "default"})
    plain = CaptionerTask(vocabulary=words, encoder={"width": 4}, decoder={"embed_dim": 8, "hidden_dim": 8,
                                                                           "attention_dim": 8})
    assert {"forward", "step"} <= set(vars(task.model.decoder))
    assert not {"forward", "step"} & set(vars(plain.model.decoder))
    assert list(task.state_dict()) == list(plain.state_dict())  # checkpoints are interchangeable
    assert task.hparams["decoder"]["compile"] == "default"


@pytest.mark.parametrize(("mode", "said"), [("fast", "compile must be null or one of default, reduce-overhead"),
                                            ("", "compile must be null or one of default, reduce-overhead"),
                                            (1, "^decoder.compile must be a string or null, got int$")])
def test_an_unknown_compile_mode_is_refused_in_one_line(mode, said) -> None:
    with pytest.raises(ValueError, match=said) as raised:
        DecoderOptions.coerce({"compile": mode})
    assert "\n" not in str(raised.value)


def test_the_task_trains_the_compiled_decoder_at_static_shapes_that_never_recompile_after_warm_up() -> None:
    """With decoder.compile, training batches of other caption counts and lengths (grouped, uneven) reuse the one
    graph captured on the first batch, and the loss is the unpadded batch's, as eager computes it."""
    from vision_attn.captioning.compiled import ROW_MULTIPLE
    from vision_attn.tasks import CaptionerTask

    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "red", "bag", "on", "the", "floor"]
    options = {"embed_dim": 8, "hidden_dim": 8, "attention_dim": 8, "dropout": 0.0}
    torch.manual_seed(0)
    task = CaptionerTask(vocabulary=words, encoder={"width": 4}, decoder={**options, "compile": "default"},
                         decoding={"max_length": 9})
    plain = CaptionerTask(vocabulary=words, encoder={"width": 4}, decoder=options, decoding={"max_length": 9})
    plain.load_state_dict(task.state_dict())
    decoder = task.model.decoder
    for name in ("forward", "step"):  # the task's compile (eager on the CPU), replaced by a counting capture
        delattr(decoder, name)
    graphs: list[int] = []

    def counting(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(len(graph.graph.nodes))
        return graph.forward

    torch.compiler.reset()  # no shapes remembered from other tests' compiles of the same code
    compile_decoder(decoder, backend=counting)
    generator = torch.Generator().manual_seed(1)
    batches = [(3, [5, 5, 5]), (3, [4, 6, 5]), (2, [7, 6]), (4, [1, 2, 1, 1])]  # images, captions per image
    for number, (images, counts) in enumerate(batches):
        annotations = torch.randn(images, 16, task.model.encoder.annotation_dim, generator=generator)
        caption_images = torch.repeat_interleave(torch.arange(images), torch.tensor(counts))
        lengths = torch.randint(1, 10, (len(caption_images),), generator=generator)
        captions = torch.zeros(len(lengths), int(lengths.max()) + 2, dtype=torch.long)
        for row, length in enumerate(lengths.tolist()):
            captions[row, : length + 2] = torch.tensor([1, *torch.randint(4, 10, (length,)).tolist(), 2])
        assert -(-len(captions) // ROW_MULTIPLE) == 2 or number == 3  # within one row bucket, but the last
        output = task._teacher_forced(annotations, captions, caption_images)
        expected = plain.model.teacher_forced(annotations, captions, caption_images)
        assert output.logits.shape == expected.logits.shape
        torch.testing.assert_close(output.logits, expected.logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(output.alphas, expected.alphas, rtol=1e-5, atol=1e-6)
        if number == 0:
            captured = len(graphs)
            assert captured >= 1
        elif number < 3:
            assert len(graphs) == captured, f"batch {number} recompiled"
    assert len(graphs) == captured + 1  # a batch of fewer rows than the bucket is one more capture, no more
