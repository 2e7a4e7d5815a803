"""The decoder through torch.compile (``decoder.compile``): the same parameters, state dict and numbers, with the T
small steps of the teacher-forced loop fused into fewer kernels (and, in reduce-overhead, replayed as CUDA
graphs). CPUs run eager: inductor's C++ code for this decoder computed wrong numbers in the torch this project
pins (``scripts/compiled_decoder_check.py`` shows it), while its GPU code equals eager."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vision_attn.captioning.decoder import AttentionDecoder


def compile_decoder(decoder: AttentionDecoder, mode: str | None = None, *, backend: str = "inductor") -> None:
    """Run ``decoder``'s teacher-forced loop (``forward``) and its ``step`` (beam search, sampling) through
    torch.compile in ``mode``, in place. ``backend`` is torch.compile's (another than inductor checks the graph
    capture alone, as the tests do)."""
    options = {"mode": mode} if backend == "inductor" else {}
    for name in ("forward", "step"):  # the methods, compiled, on the instance
        eager = getattr(decoder, name)
        compiled = torch.compile(eager, backend=backend, **options)
        setattr(decoder, name, _eager_on_cpu(eager, compiled) if backend == "inductor" else compiled)


def _eager_on_cpu(eager: Callable, compiled: Callable) -> Callable:
    """``compiled`` on an accelerator, ``eager`` on CPU tensors (said once per process)."""
    @functools.wraps(eager)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = next((value for value in args if isinstance(value, Tensor)), None)
        if first is not None and first.device.type == "cpu":
            _say_eager_on_cpu()
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)
    return call


@functools.cache
def _say_eager_on_cpu() -> None:
    logging.getLogger(__name__).warning(
        "decoder.compile: the decoder runs eager on the CPU (inductor's CPU code for it computes wrong numbers in "
        "this torch); it is compiled on GPUs")
