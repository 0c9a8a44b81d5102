"""Bounds the compiler report (experiments/codegen.py) checks the kernels against, in a module
of their own so that readers of the report (the codegen notebook) need no Triton."""

# Triton's tutorial fused backward (06-fused-attention, 4 warps, 5 stages, BLOCK_N1 128),
# compiled for sm_90a with Triton 3.6: its spill bytes, the bound the dK/dV and dQ kernels must
# beat (issue 14, ANCHORS.md).
TUTORIAL_BWD_SPILLS = {64: 980, 128: 11732}
