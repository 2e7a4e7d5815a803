"""The reference for the captioner's speed goal, used only for timing: the per-step structure of the
best-known PyTorch "Show, Attend and Tell" tutorial, re-written here. It is not part of the library."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TutorialStyleDecoder(nn.Module):
    """The reference for the captioner's speed goal: the per-step structure of the best-known PyTorch
    "Show, Attend and Tell" tutorial, re-written here for timing. Captions are sorted by length and the
    batch shrinks as they end; at every step it recomputes the encoder projection W_a a_i, gates with a
    D-sized β, and projects to the vocabulary one step at a time.
    """

    def __init__(self, *, vocab_size: int, annotation_dim: int, embed_dim: int, hidden_dim: int,
                 attention_dim: int, dropout: float = 0.5) -> None:
        super().__init__()
        self.encoder_att = nn.Linear(annotation_dim, attention_dim)
        self.decoder_att = nn.Linear(hidden_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.decode_step = nn.LSTMCell(embed_dim + annotation_dim, hidden_dim)
        self.init_h = nn.Linear(annotation_dim, hidden_dim)
        self.init_c = nn.Linear(annotation_dim, hidden_dim)
        self.f_beta = nn.Linear(hidden_dim, annotation_dim)
        self.fc = nn.Linear(hidden_dim, vocab_size)

    def forward(self, annotations: Tensor, captions: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        lengths, order = lengths.sort(descending=True)
        annotations, captions = annotations[order], captions[order]
        embedded = self.embedding(captions)
        mean = annotations.mean(dim=1)
        hidden, cell = self.init_h(mean), self.init_c(mean)
        decode_lengths = (lengths - 1).tolist()
        batch, steps = len(captions), max(decode_lengths)
        predictions = annotations.new_zeros(batch, steps, self.fc.out_features)
        for t in range(steps):
            live = sum(length > t for length in decode_lengths)
            projected = self.encoder_att(annotations[:live])  # recomputed at every step
            scores = self.full_att(F.relu(projected + self.decoder_att(hidden[:live]).unsqueeze(1))).squeeze(2)
            alpha = scores.softmax(dim=1)
            context = (annotations[:live] * alpha.unsqueeze(2)).sum(dim=1)
            context = torch.sigmoid(self.f_beta(hidden[:live])) * context
            hidden, cell = self.decode_step(torch.cat([embedded[:live, t], context], dim=1),
                                            (hidden[:live], cell[:live]))
            predictions[:live, t] = self.fc(self.dropout(hidden))
        return predictions, captions, decode_lengths
