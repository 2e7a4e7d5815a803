"""Boxes (..., 4) as [x0, y0, x1, y1] fractions of the image over a Gh×Gw grid of cells: how much of each cell a box
covers and how its area falls into the cells, (..., Gh·Gw) (object loss, grounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cell_overlap(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """The area each box shares with each cell, as a fraction of the image."""
    grid_h, grid_w = grid
    edges_x = torch.linspace(0, 1, grid_w + 1, device=boxes.device, dtype=boxes.dtype)
    edges_y = torch.linspace(0, 1, grid_h + 1, device=boxes.device, dtype=boxes.dtype)
    x0, y0, x1, y1 = boxes.unbind(-1)
    # overlap of [x0, x1] with each column [e_j, e_j+1], (..., Gw); of [y0, y1] with each row, (..., Gh)
    across = (torch.minimum(edges_x[1:], x1.unsqueeze(-1)) - torch.maximum(edges_x[:-1], x0.unsqueeze(-1)))
    down = (torch.minimum(edges_y[1:], y1.unsqueeze(-1)) - torch.maximum(edges_y[:-1], y0.unsqueeze(-1)))
    return (down.clamp_min(0).unsqueeze(-1) * across.clamp_min(0).unsqueeze(-2)).flatten(-2)  # (..., Gh·Gw)


def box_cell_coverage(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """The share of each cell that each box covers, in [0, 1]."""
    return cell_overlap(boxes, grid) * (grid[0] * grid[1])  # a cell is 1/(Gh·Gw) of the image


def box_cell_weights(boxes: Tensor, grid: tuple[int, int]) -> Tensor:
    """The share of each box's area that falls in each cell, summing to 1 (a box with no area: its corner's cell)."""
    grid_h, grid_w = grid
    cells = cell_overlap(boxes, grid)
    total = cells.sum(-1, keepdim=True)
    x0, y0 = boxes[..., 0], boxes[..., 1]
    corner = (y0.clamp(0, 1 - 1e-6) * grid_h).long() * grid_w + (x0.clamp(0, 1 - 1e-6) * grid_w).long()
    empty = F.one_hot(corner, grid_h * grid_w).to(cells.dtype)
    return torch.where(total > 0, cells / total.clamp_min(1e-12), empty)
