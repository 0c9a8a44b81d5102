"""flash_attn.layers on LongFlash: `rotary` (rotary position embeddings with flash_attn's API)."""
