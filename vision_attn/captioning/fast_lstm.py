"""The decoder's LSTM over a teacher-forced caption (nn.LSTMCell's gates, parameters and eqs. 1–3), faster on a CPU.

All the words y_{t−1} are known before the first step, so ``TeacherForcedLSTM`` takes W_ih's word columns times
E y_{t−1}, plus both biases, for all steps in one product; [z_t; h_{t−1}] by [W_ih,z  W_hh] in one product a step
instead of two; and those weights' gradient Σ_t g_tᵀ [z_t; h_{t−1}] as one product over all steps, where autograd
would add up one small product a step (``_StepsLinear``). The same sums in another order: equal to nn.LSTMCell
within float rounding (``tests/test_captioner_model.py``). Only CPU tensors outside torch.compile with a large
recurrent weight take it (``applies``); the compiled decoder fuses the steps its own way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LARGE_WEIGHT = 2**20  # the recurrent weight [W_ih,z  W_hh] from which it pays (docs/experiment-log.md)


def applies(embedded: Tensor, cell: nn.LSTMCell) -> bool:
    """Whether the loop over ``embedded`` takes ``TeacherForcedLSTM``: CPU tensors, eager, a large recurrent weight
    (a small one's per-step gradient is cheap, and the faster form's extra work outweighs what it saves)."""
    recurrent_weight = cell.weight_ih.shape[0] * (cell.input_size - embedded.shape[-1] + cell.hidden_size)
    return embedded.device.type == "cpu" and not torch.compiler.is_compiling() and recurrent_weight >= LARGE_WEIGHT


@dataclass
class _Steps:  # what ``_StepsLinear`` keeps across the steps of one forward: their inputs, their outputs' gradients
    inputs: dict[int, Tensor] = field(default_factory=dict)
    grads: dict[int, Tensor] = field(default_factory=dict)


class _StepsLinear(torch.autograd.Function):
    """x_t Wᵀ at step ``index``; backward gives x_t its gradient at once, and W its gradient over all steps at step 0,
    whose backward runs last: every later step depends on its output, and autograd waits for all of a node's."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")  # backward under forward's autocast: bf16-mixed's products as forward's
    def forward(ctx, x: Tensor, weight: Tensor, steps: _Steps, index: int) -> Tensor:
        ctx.save_for_backward(weight)
        ctx.steps, ctx.index = steps, index
        steps.inputs[index] = x.detach()
        return x.mm(weight.t())

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        (weight,), steps = ctx.saved_tensors, ctx.steps
        steps.grads[ctx.index] = grad
        input_grad = grad.mm(weight) if ctx.needs_input_grad[0] else None
        weight_grad = None
        if ctx.index == 0:  # the last step back: every other step's gradient is in
            if ctx.needs_input_grad[1]:
                grads, inputs = zip(*[(steps.grads[t], steps.inputs[t]) for t in sorted(steps.grads)], strict=True)
                weight_grad = torch.cat(grads).t().mm(torch.cat(inputs))  # Σ_t g_tᵀ x_t as one product
            steps.grads.clear()
        return input_grad, weight_grad, None, None


class TeacherForcedLSTM:
    """``cell`` (``nn.LSTMCell`` over [E y; z]) run over the T known input words ``embedded`` (B', T, E), one step
    per call, in order: ``step(context, (h, c))`` at step t gives (h_t, c_t)."""

    def __init__(self, cell: nn.LSTMCell, embedded: Tensor) -> None:
        word_weight, context_weight = cell.weight_ih.tensor_split([embedded.shape[-1]], dim=1)  # [W_ih,y  W_ih,z]
        bias = cell.bias_ih + cell.bias_hh if cell.bias else None
        # W_ih,y E y_{t−1} + b for all t, (B', 4H) each: unbound, so that backward stacks their gradients once
        self.word_gates = F.linear(embedded, word_weight, bias).unbind(1)
        self.weight = torch.cat([context_weight, cell.weight_hh], dim=1)  # [W_ih,z  W_hh], (4H, D + H)
        self.steps, self.index = _Steps(), 0

    def step(self, context: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """(h_t, c_t) from z_t and (h_{t−1}, c_{t−1}), at the next step."""
        hidden, cell = state
        recurrent = _StepsLinear.apply(torch.cat([context, hidden], dim=1), self.weight, self.steps, self.index)
        gates = self.word_gates[self.index] + recurrent
        self.index += 1
        input_gate, forget_gate, candidate, output_gate = gates.chunk(4, dim=1)
        cell = torch.sigmoid(forget_gate) * cell + torch.sigmoid(input_gate) * torch.tanh(candidate)
        return torch.sigmoid(output_gate) * torch.tanh(cell), cell
