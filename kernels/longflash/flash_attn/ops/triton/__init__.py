"""flash_attn.ops.triton on LongFlash: `rotary.apply_rotary` (PyTorch ops, not a Triton kernel)."""
