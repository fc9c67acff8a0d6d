"""Train a small byte-level causal transformer language model whose attention is flash_attention.

Run ``python -m jax_flash_metal.examples.train_lm`` (needs the ``[examples]`` extra: optax, tqdm).

The model is a decoder-only transformer over raw bytes (vocabulary 256): token embedding (tied with
the output layer), pre-norm blocks of grouped-query attention with rotary position embeddings
(Su et al., "RoFormer", 2021) and a GELU MLP, RMSNorm (Zhang & Sennrich, 2019) everywhere. Every
attention call is ``jax_flash_metal.flash_attention(..., is_causal=True, implementation=...)``.
Parameters are a plain pytree of arrays; training is ``jax.jit`` of ``jax.value_and_grad`` with
optax AdamW and a warmup + cosine learning-rate schedule.

The default corpus is the ``.py`` files of the running Python's standard library (present on every
machine); ``--text PATH`` trains on any file instead. After training the script prints the loss at
the start and end, a generated sample, and the largest difference between this implementation's
attention gradients and those of ``jax_flash_metal.reference_attention`` on one batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jax_flash_metal
from jax_flash_metal import flash_attention, implementations, reference_attention


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training hyper-parameters."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    rope_base: float = 10000.0
    attn_dtype: str = "float32"

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.d_model


# About a minute on 2 CPU cores with the xla implementation.
DEFAULT = Config(layers=2, d_model=128, heads=4, kv_heads=2, head_dim=32, seq_len=128,
                 batch_size=16, steps=200, lr=3e-3, warmup=20)
# For the emulator (every kernel interpreted on the CPU) and quick tests.
TINY = Config(layers=1, d_model=32, heads=2, kv_heads=1, head_dim=16, seq_len=32, batch_size=4,
              steps=30, lr=1e-2, warmup=3)


# ---------------------------------------------------------------------------------------- data

def stdlib_corpus(max_bytes: int) -> tuple[bytes, str]:
    """The first ``max_bytes`` bytes of the standard library's top-level ``.py`` files, in sorted
    file-name order (deterministic for a given Python), and a description of the source.

    Raises FileNotFoundError if the standard library has no ``.py`` files (e.g. a zipped stdlib).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library at {root}; use --text PATH")
    chunks, size, used = [], 0, 0
    for f in files:
        data = f.read_bytes()[: max_bytes - size]
        chunks.append(data)
        size += len(data)
        used += 1
        if size >= max_bytes:
            break
    return b"".join(chunks), f"{used} .py files of the standard library ({root})"


def load_text(path: str | None, max_bytes: int) -> tuple[np.ndarray, str]:
    """Corpus bytes as uint8 [n] (at most ``max_bytes``) and a description of their source."""
    if path is None:
        data, source = stdlib_corpus(max_bytes)
    else:
        data, source = Path(path).read_bytes()[:max_bytes], path
    return np.frombuffer(data, dtype=np.uint8), source


def split(data: np.ndarray, seq_len: int, holdout: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Train / held-out split of the byte array (the held-out part is the tail).

    Raises ValueError if either part is shorter than one training window (seq_len + 1 bytes).
    """
    cut = int(len(data) * (1 - holdout))
    train, held = data[:cut], data[cut:]
    if min(len(train), len(held)) < seq_len + 1:
        raise ValueError(f"the text ({len(data)} bytes) is too short for windows of {seq_len + 1} "
                         f"bytes with a {holdout:.0%} held-out tail")
    return train, held


def windows(data: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int):
    """Random (inputs, targets) int32 [batch_size, seq_len]; targets are inputs shifted by one."""
    starts = rng.integers(0, len(data) - seq_len, size=batch_size)
    x = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return x[:, :-1], x[:, 1:]


# --------------------------------------------------------------------------------------- model

def init_params(cfg: Config, key: jax.Array) -> dict:
    """Parameter pytree: normal(0.02) weights, residual output projections scaled by
    1/sqrt(2 * layers) (GPT-2's initialisation), unit norm gains."""
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.layers)
    keys = iter(jax.random.split(key, 1 + 6 * cfg.layers))

    def normal(shape, s=std):
        return s * jax.random.normal(next(keys), shape, jnp.float32)

    d, hd = cfg.d_model, cfg.head_dim
    layers = [
        {
            "attn_norm": jnp.ones((d,)),
            "wq": normal((d, cfg.heads * hd)),
            "wk": normal((d, cfg.kv_heads * hd)),
            "wv": normal((d, cfg.kv_heads * hd)),
            "wo": normal((cfg.heads * hd, d), out_std),
            "mlp_norm": jnp.ones((d,)),
            "w1": normal((d, cfg.mlp_hidden)),
            "w2": normal((cfg.mlp_hidden, d), out_std),
        }
        for _ in range(cfg.layers)
    ]
    return {"embed": normal((256, d)), "layers": layers, "final_norm": jnp.ones((d,))}


def rms_norm(x, gain, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def rope(x, base):
    """Rotary position embedding of x [batch, len, heads, dim] (rotate-half form, positions
    0..len-1)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs  # [len, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv(layer: dict, x, cfg: Config):
    """Query [B, T, heads, head_dim] and key/value [B, T, kv_heads, head_dim] of one block,
    rotary-embedded (q, k), from the residual stream x [B, T, d_model]."""
    b, t, _ = x.shape
    h = rms_norm(x, layer["attn_norm"])
    q = (h @ layer["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = (h @ layer["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = (h @ layer["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    return rope(q, cfg.rope_base), rope(k, cfg.rope_base), v


def make_attention(implementation: str | None, dtype: str = "float32", *, reference=False):
    """Causal attention (q, k, v) -> out [B, T, heads, head_dim] float32, computed in ``dtype``
    by flash_attention with ``implementation``, or by reference_attention if ``reference``."""

    def attend(q, k, v):
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        if reference:
            out = reference_attention(q, k, v, is_causal=True)
        else:
            out = flash_attention(q, k, v, is_causal=True, implementation=implementation)
        return out.astype(jnp.float32)

    return attend


def forward(params: dict, tokens, cfg: Config, attend):
    """Logits [B, T, 256] float32 for byte tokens int32 [B, T]."""
    x = params["embed"][tokens]
    b, t, _ = x.shape
    for layer in params["layers"]:
        q, k, v = qkv(layer, x, cfg)
        x = x + attend(q, k, v).reshape(b, t, -1) @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + jax.nn.gelu(h @ layer["w1"]) @ layer["w2"]
    return rms_norm(x, params["final_norm"]) @ params["embed"].T


def loss_fn(params, inputs, targets, cfg: Config, attend):
    """Mean next-byte cross-entropy (nats)."""
    logits = forward(params, inputs, cfg, attend)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ------------------------------------------------------------------------------------ training

def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW with linear warmup then cosine decay to 10% of the peak, global-norm clipping at 1;
    weight decay only on matrices (not on norm gains)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), end_value=0.1 * cfg.lr)
    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decay_mask))


def train(cfg: Config, data: np.ndarray, implementation: str | None, *, seed: int = 0,
          progress: bool = True):
    """Train from scratch on the uint8 byte array ``data``; returns (params, per-step losses)."""
    attend = make_attention(implementation, cfg.attn_dtype)
    optimizer = make_optimizer(cfg)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, cfg, attend)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = init_params(cfg, jax.random.PRNGKey(seed))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses = []
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=not progress)
    start = None  # timing starts after step 1, which includes compilation
    for i in bar:
        params, opt_state, loss = step(params, opt_state, *windows(data, rng, cfg.batch_size,
                                                                   cfg.seq_len))
        losses.append(float(loss))  # also waits for the step, so tokens/s is honest
        if start is None:
            start = time.perf_counter()
            rate = "-"
        else:
            rate = f"{i * tokens_per_step / (time.perf_counter() - start):,.0f}"
        bar.set_postfix({"loss": f"{losses[-1]:.3f}", "tok/s": rate})
    return params, losses


def make_evaluator(cfg: Config, implementation: str | None):
    """A function (params, data) -> mean loss on 4 fixed random windows of the uint8 array data."""
    attend = make_attention(implementation, cfg.attn_dtype)
    loss = jax.jit(lambda p, x, y: loss_fn(p, x, y, cfg, attend))

    def evaluate(params, data: np.ndarray, batches: int = 4, seed: int = 1) -> float:
        rng = np.random.default_rng(seed)
        return float(np.mean([loss(params, *windows(data, rng, cfg.batch_size, cfg.seq_len))
                              for _ in range(batches)]))

    return evaluate


def generate(params, cfg: Config, implementation: str | None, prompt: bytes, length: int, *,
             temperature: float = 0.8, seed: int = 0) -> bytes:
    """Continue ``prompt`` by ``length`` bytes, one jit-compiled forward per byte over the last
    ``seq_len`` bytes (zero-padded at the end; causal attention makes the padding invisible).
    ``temperature`` 0 means greedy."""
    if not prompt:
        raise ValueError("the prompt must not be empty")
    attend = make_attention(implementation, cfg.attn_dtype)

    @jax.jit
    def next_byte(params, window, pos, key):
        logits = forward(params, window[None], cfg, attend)[0, pos]
        if temperature > 0:
            return jax.random.categorical(key, logits / temperature)
        return jnp.argmax(logits)

    out = list(prompt)
    key = jax.random.PRNGKey(seed)
    for _ in range(length):
        context = out[-cfg.seq_len:]
        window = np.zeros(cfg.seq_len, np.int32)
        window[: len(context)] = context
        key, sub = jax.random.split(key)
        out.append(int(next_byte(params, window, len(context) - 1, sub)))
    return bytes(out)


def gradient_check(params, cfg: Config, data: np.ndarray, implementation: str | None,
                   seed: int = 2) -> dict:
    """Largest gradient differences between flash_attention (``implementation``) and
    reference_attention on one batch.

    On a random window of ``data``, takes the first layer's q, k, v under ``params`` and the
    gradients of sum(attention(q, k, v) * c) (c a fixed random cotangent) w.r.t. q, k, v. Returns
    {"dq"/"dk"/"dv": max |flash - reference| of that gradient, "scale": max |reference gradient|}.
    """
    inputs, _ = windows(data, np.random.default_rng(seed), cfg.batch_size, cfg.seq_len)
    q, k, v = qkv(params["layers"][0], params["embed"][inputs], cfg)
    c = jax.random.normal(jax.random.PRNGKey(seed), q.shape, jnp.float32)

    def grads(attend):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * c), (0, 1, 2)))(q, k, v)

    got = grads(make_attention(implementation, cfg.attn_dtype))
    want = grads(make_attention(None, cfg.attn_dtype, reference=True))
    result = {name: float(jnp.max(jnp.abs(g - w)))
              for name, g, w in zip(("dq", "dk", "dv"), got, want)}
    result["scale"] = max(float(jnp.max(jnp.abs(w))) for w in want)
    return result


# ----------------------------------------------------------------------------------------- cli

def add_common_args(p: argparse.ArgumentParser, implementation_help: str) -> None:
    """--text and --max-bytes (the arguments of ``load_text``) and --implementation."""
    p.add_argument("--text", help="train on this file (default: the standard library's .py files)")
    p.add_argument("--max-bytes", type=int, default=1 << 20, help="corpus size cap (default 1 MiB)")
    p.add_argument("--implementation", choices=["xla", "emulator", "metal"], default=None,
                   help=implementation_help)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.examples.train_lm",
        description="Train a byte-level transformer LM whose attention is flash_attention.")
    add_common_args(p, "flash_attention implementation (default: the package's default, i.e. "
                       "metal when available, else xla; the emulator is slow by design and "
                       "switches to the tiny configuration)")
    p.add_argument("--tiny", action="store_true", help="use the tiny configuration")
    for name, typ in (("steps", int), ("batch-size", int), ("seq-len", int), ("layers", int),
                      ("d-model", int), ("heads", int), ("kv-heads", int), ("head-dim", int),
                      ("lr", float), ("warmup", int)):
        p.add_argument(f"--{name}", type=typ, default=None,
                       help=f"override the configuration's {name.replace('-', '_')}")
    p.add_argument("--attn-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of q/k/v given to flash_attention (default float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-bytes", type=int, default=None,
                   help="length of the generated sample (default 300, 60 for the tiny config)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature, 0 = greedy")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, tiny: bool) -> Config:
    """The DEFAULT (or TINY) configuration with the command-line overrides applied."""
    base = TINY if tiny else DEFAULT
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                 if getattr(args, f.name, None) is not None}
    cfg = dataclasses.replace(base, **overrides)
    if cfg.head_dim % 2:
        raise SystemExit(f"--head-dim must be even for rotary embeddings, got {cfg.head_dim}")
    return cfg


def main(argv=None) -> dict:
    """Command-line entry point; returns the numbers it printed (for tests)."""
    args = parse_args(argv)
    try:
        resolved = implementations.resolve(args.implementation, jax.default_backend())
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"error: {e}") from None
    tiny = args.tiny or resolved == "emulator"
    cfg = config_from_args(args, tiny)
    print(f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}; attention implementation: {resolved} "
          f"({jax_flash_metal.devices().get(resolved, '?')}; available here: "
          f"{', '.join(implementations.available())})")
    if resolved == "emulator":
        print("The emulator interprets the Metal kernels on the CPU: it is slow by design (it "
              "exists to test the kernels without a Mac), so this run uses the tiny configuration.")

    data, source = load_text(args.text, args.max_bytes)
    train_data, held_out = split(data, cfg.seq_len)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(
        jax.eval_shape(lambda key: init_params(cfg, key), jax.random.PRNGKey(0))))
    print(f"corpus: {len(data):,} bytes from {source}")
    print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} query / {cfg.kv_heads} "
          f"kv heads of dim {cfg.head_dim}, {n_params / 1e6:.2f} M parameters; attention in "
          f"{cfg.attn_dtype}")
    print(f"training: {cfg.steps} steps of {cfg.batch_size} x {cfg.seq_len} bytes, AdamW lr "
          f"{cfg.lr:g} (warmup {cfg.warmup}, cosine)")

    evaluate = make_evaluator(cfg, resolved)
    initial_eval = evaluate(init_params(cfg, jax.random.PRNGKey(args.seed)), held_out)
    t0 = time.perf_counter()
    params, losses = train(cfg, train_data, resolved, seed=args.seed, progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    final_eval = evaluate(params, held_out)
    end = float(np.mean(losses[-10:]))
    print(f"loss (nats/byte): start {losses[0]:.3f} -> end {end:.3f} (mean of the last "
          f"{min(10, len(losses))} steps); held-out {initial_eval:.3f} -> {final_eval:.3f} "
          f"({final_eval / math.log(2):.2f} bits/byte); {seconds:.1f} s")

    length = args.sample_bytes if args.sample_bytes is not None else (60 if tiny else 300)
    sample = generate(params, cfg, resolved, args.prompt.encode(), length,
                      temperature=args.temperature, seed=args.seed)
    print(f"sample (temperature {args.temperature:g}):")
    print("-" * 72)
    print(sample.decode("utf-8", errors="replace"))
    print("-" * 72)

    check = gradient_check(params, cfg, held_out, resolved)
    print(f"gradient check on one batch, layer-0 attention, flash_attention[{resolved}] vs "
          f"reference_attention: max |diff| dq {check['dq']:.2e}, dk {check['dk']:.2e}, "
          f"dv {check['dv']:.2e} (largest gradient entry {check['scale']:.2e})")
    return {"losses": losses, "initial_eval": initial_eval, "final_eval": final_eval,
            "sample": sample, "check": check, "implementation": resolved}


if __name__ == "__main__":
    main(sys.argv[1:])
