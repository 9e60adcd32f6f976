"""A model's parameters grouped into layers: DiLoCo's fragments are whole
layers (passes/pseudo_gradients.py), and a schedule refuses more fragments
than layers (runtime/schedule.py)."""

from __future__ import annotations

from typing import Sequence


def layers_of(names: Sequence[str]) -> list[list[int]]:
    """The parameters (by name, in order) grouped by the module that owns them:
    runs of consecutive names with the same prefix before the last dot."""
    layers: list[list[int]] = []
    for i, name in enumerate(names):
        if layers and names[layers[-1][0]].rpartition(".")[0] == name.rpartition(".")[0]:
            layers[-1].append(i)
        else:
            layers.append([i])
    return layers
