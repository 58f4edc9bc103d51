"""Pallas Mosaic GPU (Hopper) kernels behind jax_overlap's `impl="pallas"`.

One module per kernel family, plus the pieces every kernel shares.
"""
