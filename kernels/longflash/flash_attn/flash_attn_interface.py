"""flash_attn.flash_attn_interface on LongFlash: the module path that code written for
FlashAttention also imports from (`from flash_attn.flash_attn_interface import
flash_attn_varlen_func`), holding the same functions as `longflash.flash_attn`."""

from . import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,  # noqa: F401
               flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
               flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
