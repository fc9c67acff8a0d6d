"""The xla implementation: blockwise FlashAttention-2 in jax.numpy, its tile math and block
sizes."""
