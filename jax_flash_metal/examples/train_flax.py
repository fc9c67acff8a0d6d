"""Train one small Flax NNX transformer twice: with Flax's attention, then with jax_flash_metal's.

Run ``python -m jax_flash_metal.examples.train_flax`` (needs the ``[examples]`` extra: flax, optax,
tqdm). Both runs start from the same weights and see the same batches; the only difference is
``attention_fn=`` of ``flax.nnx.MultiHeadAttention`` (Flax's ``dot_product_attention``, or
``jax_flash_metal.flax.attention_fn``). The script prints both loss curves side by side and the
median time per training step of each.

The model is a byte-level causal language model: token and learned position embeddings, pre-norm
blocks (RMSNorm, ``nnx.MultiHeadAttention`` with a causal mask, GELU MLP), output layer tied to the
token embedding. The corpus and batches come from ``train_lm`` (by default the standard library's
``.py`` files); training is ``jax.jit`` of ``jax.value_and_grad`` with optax AdamW.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash_metal
from jax_flash_metal._extras import needs
from jax_flash_metal.lowering import dispatch

with needs("examples", "jax_flash_metal.examples.train_flax", ("optax", "flax", "tqdm")):
    import optax
    from flax import nnx
    from tqdm import tqdm

from jax_flash_metal.tools.cli import HelpFormatter, count
from jax_flash_metal.examples.train_lm import add_common_args, load_text, split, windows
from jax_flash_metal.flax import attention_fn as flash_attention_fn


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training hyper-parameters."""

    layers: int
    d_model: int
    heads: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float


# Both runs take 17-25 s on 2 shared CPU cores (XLA:CPU).
DEFAULT = Config(layers=2, d_model=64, heads=4, seq_len=64, batch_size=16, steps=150, lr=3e-3)
# For the emulator (every kernel interpreted on the CPU) and tests.
TINY = Config(layers=1, d_model=32, heads=2, seq_len=16, batch_size=2, steps=20, lr=1e-2)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, cfg: Config, attention_fn: Callable[..., Any], rngs: nnx.Rngs):
        d = cfg.d_model
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.heads, d, decode=False, attention_fn=attention_fn,
                                           rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp_in = nnx.Linear(d, 4 * d, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        # [batch, 1, seq_len, seq_len]
        mask = nnx.make_causal_mask(x[..., 0], dtype=jnp.bool_)
        x = x + self.attn(self.attn_norm(x), mask=mask)
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class Model(nnx.Module):
    """Byte-level causal LM: tokens int32 [batch, seq_len] -> logits float32 [batch, seq_len,
    256]."""

    def __init__(self, cfg: Config, attention_fn: Callable[..., Any], rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, cfg.d_model, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(),
                                                           (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.Sequential(*(Block(cfg, attention_fn, rngs) for _ in range(cfg.layers)))
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position[...][: tokens.shape[-1]]
        return self.embed.attend(self.norm(self.blocks(x)))


def train(cfg: Config, data: np.ndarray, attention_fn: Callable[..., Any], *, seed: int = 0,
          progress: bool = True, desc: str = "train"):
    """Train a fresh Model (weights from ``seed``) on random windows of the uint8 array ``data``,
    with a progress bar named ``desc`` (stderr) when ``progress``.

    Returns (per-step losses, per-step seconds); step 0's time includes compilation.
    """
    graphdef, params, *rest = nnx.split(Model(cfg, attention_fn, nnx.Rngs(seed)), nnx.Param, ...)
    optimizer = optax.adamw(cfg.lr)

    def loss_fn(params, inputs, targets):
        logits = nnx.merge(graphdef, params, *rest)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(params)
    rng = np.random.default_rng(seed)
    losses, seconds = [], []
    for _ in tqdm(range(cfg.steps), desc=desc, unit="step", disable=not progress):
        batch = windows(data, rng, cfg.batch_size, cfg.seq_len)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))  # waits for the step
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.examples.train_flax",
        description="Train a Flax NNX transformer with Flax's attention and with flash_attention.",
        formatter_class=HelpFormatter)
    add_common_args(p, "flash_attention implementation (default: the package's choice per "
                       "call); the emulator is slow by design and uses the tiny configuration")
    p.add_argument("--tiny", action="store_true", help="use the tiny configuration")
    p.add_argument("--steps", type=int, default=None,
                   help="override the number of steps (default: the configuration's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Command-line entry point; returns the numbers it printed (for tests)."""
    args = parse_args(argv)
    cfg = TINY if args.tiny or args.implementation == "emulator" else DEFAULT
    cfg = dataclasses.replace(cfg, steps=cfg.steps if args.steps is None else args.steps)
    # What implementation=None picks for this model's calls (float32, causal mask from Flax).
    call = ("fwd", jnp.dtype(jnp.float32), cfg.d_model // cfg.heads, ("mask",))
    try:
        resolved = dispatch.resolve(args.implementation, jax.default_backend(), call=call)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"error: {e}") from None
    data, source = load_text(args.text, args.max_bytes)
    train_data, _ = split(data, cfg.seq_len)
    print(f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}; attention "
          f"implementation: {resolved} ({jax_flash_metal.devices().get(resolved, '?')}); corpus: "
          f"{len(data):,} bytes from {source}")
    print(f"model: {count(cfg.layers, 'layer')}, d_model {cfg.d_model}, "
          f"{count(cfg.heads, 'head')}, causal; {count(cfg.steps, 'step')} of {cfg.batch_size} x "
          f"{cfg.seq_len} bytes, AdamW lr {cfg.lr:g}")

    runs: dict[str, Callable[..., Any]] = {
        "flax": nnx.dot_product_attention,
        f"jax_flash_metal[{resolved}]": functools.partial(
            flash_attention_fn, implementation=args.implementation)}
    results = {name: train(cfg, train_data, fn, seed=args.seed, progress=not args.no_progress,
                           desc=name) for name, fn in runs.items()}
    (ref_name, (ref_losses, ref_s)), (our_name, (our_losses, our_s)) = results.items()
    print(f"{'step':>5} {ref_name:>12} {our_name:>24} {'difference':>11}")
    every = max(1, cfg.steps // 10)
    for i in sorted({*range(0, cfg.steps, every), cfg.steps - 1}):
        print(f"{i:>5} {ref_losses[i]:>12.4f} {our_losses[i]:>24.4f} "
              f"{our_losses[i] - ref_losses[i]:>11.2e}")
    times = {name: float(np.median(s[1:])) if len(s) > 1 else float("nan")
             for name, (_, s) in results.items()}
    print("median ms per step (after the first, which compiles): " + ", ".join(
        f"{name} {1e3 * t:.1f}" for name, t in times.items()))
    return {"losses": {name: losses for name, (losses, _) in results.items()},
            "step_seconds": times}


if __name__ == "__main__":
    main(sys.argv[1:])
