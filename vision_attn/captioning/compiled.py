"""The decoder through torch.compile (``decoder.compile``): the same parameters, state dict and numbers, the T steps
of the teacher-forced loop fused into fewer kernels (reduce-overhead: CUDA graphs). CPUs run eager: inductor's C++
code for this decoder computes wrong numbers in the pinned torch (``scripts/compiled_decoder_check.py``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vision_attn.captioning.decoder import AttentionDecoder, DecoderOutput
from vision_attn.data.vocabulary import PAD_ID


def compile_decoder(decoder: AttentionDecoder, mode: str | None = None, *, backend: str = "inductor") -> None:
    """``decoder``'s ``forward`` and ``step`` through torch.compile in ``mode``, in place (another ``backend`` than
    inductor checks the graph capture alone, as the tests do)."""
    options = {"mode": mode} if backend == "inductor" else {}
    for name in ("forward", "step"):  # the methods, compiled, on the instance
        eager = getattr(decoder, name)
        compiled = torch.compile(eager, backend=backend, **options)
        setattr(decoder, name, _eager_on_cpu(eager, compiled) if backend == "inductor" else compiled)


def _eager_on_cpu(eager: Callable, compiled: Callable) -> Callable:
    # ``compiled`` on an accelerator, ``eager`` on CPU tensors (said once per process)
    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = next((value for value in args if isinstance(value, Tensor)), None)
        if first is not None and first.device.type == "cpu":
            _say_eager_on_cpu()
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    call.eager_on_cpu = True  # type: ignore[attr-defined]
    return call


def runs_compiled(decoder: AttentionDecoder, device: torch.device) -> bool:
    """Whether ``decoder``'s teacher-forced loop runs compiled on ``device`` (not on a CPU through inductor)."""
    forward = vars(decoder).get("forward")
    return forward is not None and not (getattr(forward, "eager_on_cpu", False) and device.type == "cpu")


@functools.cache
def _say_eager_on_cpu() -> None:
    logging.getLogger(__name__).warning(
        "decoder.compile: the decoder runs eager on the CPU (inductor's CPU code for it computes wrong numbers in "
        "this torch); it is compiled on GPUs")


ROW_MULTIPLE = 8  # the compiled loop's caption rows are rounded up to a multiple of this: few shapes, few graphs


def static_batch(annotations: Tensor, captions: Tensor, caption_images: Tensor | None, *,
                 width: int) -> tuple[Tensor, Tensor]:
    """A teacher-forced batch at static shapes, so that other caption counts and lengths reuse one graph: an
    annotation copy per caption (N', L, D) and the captions (N', max(``width``, T+1)), N' the N rounded up to a
    multiple of ``ROW_MULTIPLE``; the added rows (of image 0) and columns are <pad>, cut off by ``real_part``."""
    count, length = captions.shape
    rows = -(-count // ROW_MULTIPLE) * ROW_MULTIPLE
    images = caption_images if caption_images is not None else torch.arange(count, device=captions.device)
    images = torch.cat([images, images.new_zeros(rows - count)])
    return annotations[images], F.pad(captions, (0, max(width, length) - length, 0, rows - count), value=PAD_ID)


def real_part(output: DecoderOutput, rows: int, steps: int) -> DecoderOutput:
    """``output`` of a ``static_batch`` cut back to its first ``rows`` captions and ``steps`` steps."""
    return DecoderOutput(**{name: None if value is None else value[:rows, :steps]
                            for name, value in vars(output).items()})
