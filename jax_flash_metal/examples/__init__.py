"""Runnable examples of jax_flash_metal (``python -m jax_flash_metal.examples.train_lm``).

They need the ``[examples]`` extra (optax, tqdm).
"""
