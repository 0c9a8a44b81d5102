"""flash_attn.bert_padding on LongFlash: between padded batches (batch, seqlen, ...) and the
packed tokens (total_tokens, ...) that the varlen functions take, with flash_attn 2.7's names,
arguments and return values:

    from longflash.flash_attn.bert_padding import pad_input, unpad_input
    x, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden_states, attention_mask)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out, indices, batch, seqlen)        # padded positions are 0

Plain PyTorch indexing (gradients by autograd), not FlashAttention's hand-written autograd
functions; indices are int64, cu_seqlens int32, as there. max_seqlen is read back to the host
(an int), as in FlashAttention.
"""

import torch
import torch.nn.functional as F


def index_first_axis(input, indices):
    """input[indices] along the first axis: (first_axis, ...) -> (len(indices), ...)."""
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    """A zero tensor (first_axis_dim, ...) with rows indices set to values (len(indices), ...)."""
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The tokens of hidden_states (batch, seqlen, ...) where attention_mask (batch, seqlen;
    bool or 0/1) is set, or unused_mask (allocated but unused tokens, kept in the packed
    tensor): (packed (total, ...), indices (total,) into the flattened batch, cu_seqlens
    (batch + 1,) int32, max_seqlen_in_batch int, seqused (batch,) int32: the tokens of each
    sequence set in attention_mask alone)."""
    kept = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = kept.flatten().nonzero().flatten()
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return (index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens,
            max_seqlen, seqused)


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Several short sequences packed into each row: attention_mask_in_length (batch, seqlen),
    int, holds the lengths of row b's sequences first (e.g. [2, 3, 0, 0, 0, 0]: tokens 0-1
    and 2-4 are two sequences, token 5 padding). Returns (packed, indices, cu_seqlens over
    every sequence of every row, max_seqlen_in_batch), as unpad_input without seqused."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    used = torch.arange(seqlen, device=lengths.device) < lengths.sum(-1, keepdim=True)
    seqlens = lengths.flatten()[lengths.flatten() > 0].to(torch.int32)
    indices = used.flatten().nonzero().flatten()
    cu_seqlens = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: packed tokens (total, ...) back to (batch, seqlen, ...),
    zero where no token was kept."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
