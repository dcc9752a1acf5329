"""``--text-storage trimmed``: text embeddings stored as their prompt's rows only, and the padded tensor restored.

A trimmed sample holds ``text_embeds`` of shape ``[seq_len, D]`` and ``seq_len``; the cache's spec
(``cache.json``: ``spec.text_max_length``) gives the length the recipe pads to. Trimming needs
``--text-padding zeros``, so the rows it leaves out are zeros and `restore_padded` rebuilds the exact tensor.
"""

from __future__ import annotations

import torch


def trim(embeds: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` rows of a padded ``[max_length, D]`` embedding, as a tensor of their own."""
    return embeds[:seq_len].clone()


def restore_padded(embeds: torch.Tensor, max_length: int) -> torch.Tensor:
    """A trimmed ``[seq_len, D]`` embedding → the padded ``[max_length, D]`` one (zeros past seq_len), same dtype.
    A padded embedding (``max_length`` rows already) comes back as it is."""
    rows = embeds.shape[0]
    if rows > max_length:
        raise ValueError(f"the embedding has {rows} rows, more than max_length {max_length}")
    if rows == max_length:
        return embeds
    padded = embeds.new_zeros((max_length, *embeds.shape[1:]))
    padded[:rows] = embeds
    return padded
