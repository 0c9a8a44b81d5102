"""flash_attn.ops on LongFlash: `triton.rotary.apply_rotary`, the rotary helper's module path."""
