"""The "cudnn" implementation: jax.nn's cuDNN attention for the calls it computes exactly as
``flash_attention`` defines them, and the static predicate that says which those are."""
