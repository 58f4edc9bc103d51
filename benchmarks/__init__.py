"""Side-by-side benchmarks of jax_overlap's ops and the baselines a user would pick instead."""
