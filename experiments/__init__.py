"""LongFlash experiments: one script per research question, plus their shared helpers."""
