"""Small reference models built on longflash.nn (used by the experiments, importable by users)."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
