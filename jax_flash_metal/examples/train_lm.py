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
the start and end, a generated sample (sampled with a KV cache: one ``flash_attention`` call per
layer and new byte, ``causal_alignment="bottom_right"`` with ``key_value_seq_lengths``, which the
fused implementations run with the split-KV decode kernels; ``--paged`` keeps the cache in pages
read through ``page_table``, with the same bytes) with its tokens/s, and the largest
difference between this implementation's attention gradients and those of
``jax_flash_metal.reference_attention`` on one batch.

``--mesh data=N,sp=M`` trains data- and sequence-parallel over every device of every process
(batch split over "data", context parallelism with ``sequence_axis_name="sp"``; with
``--coordinator``, ``--num-processes`` and ``--process-id``, ``jax.distributed`` on gloo CPU
collectives) and prints each step's loss, the same as on one device.
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flash_metal
from jax_flash_metal import flash_attention, implementations, reference_attention
from jax_flash_metal._extras import needs
from jax_flash_metal.lowering import dispatch
from jax_flash_metal.tools.cli import HelpFormatter, count, default_device, emulator_on_the_host
from jax_flash_metal.ring_attention import shard_map

with needs("examples", "jax_flash_metal.examples.train_lm", ("optax", "tqdm")):
    import optax
    from tqdm import tqdm


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


def rope(x, base, offset=0):
    """Rotary position embedding of x [batch, len, heads, dim] (rotate-half form, positions
    offset..offset+len-1; offset may be a traced int32 scalar)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    positions = offset + jnp.arange(x.shape[1], dtype=jnp.float32)
    angles = positions[:, None] * freqs  # [len, half]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv(layer: dict, x, cfg: Config, offset=0):
    """Query [B, T, heads, head_dim] and key/value [B, T, kv_heads, head_dim] of one block,
    rotary-embedded (q, k) at positions offset.., from the residual stream x [B, T, d_model]."""
    b, t, _ = x.shape
    h = rms_norm(x, layer["attn_norm"])
    q = (h @ layer["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
    k = (h @ layer["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    v = (h @ layer["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
    return rope(q, cfg.rope_base, offset), rope(k, cfg.rope_base, offset), v


def make_attention(implementation: str | None, dtype: str = "float32", *, reference=False,
                   mesh=None):
    """Causal attention (q, k, v) -> out [B, T, heads, head_dim] float32, computed in ``dtype``
    by flash_attention with ``implementation``, or by reference_attention if ``reference``.
    With a ``mesh`` (axes "data" and "sp"): batch split over "data" and each sequence over "sp",
    context parallelism in ``shard_map`` (``sequence_axis_name="sp"``)."""

    def attend(q, k, v):
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        if reference:
            out = reference_attention(q, k, v, is_causal=True)
        else:
            out = flash_attention(q, k, v, is_causal=True, implementation=implementation,
                                  sequence_axis_name=None if mesh is None else "sp")
        return out.astype(jnp.float32)

    if mesh is None:
        return attend
    spec = P("data", "sp")
    return shard_map(attend, mesh, (spec,) * 3, spec)


def make_cached_attention(implementation: str | None, dtype: str = "float32", page_table=None):
    """Attention of new queries q [B, Tq, heads, head_dim] (the last Tq of the first kv_len
    positions) against a KV cache k, v [B, Tmax, kv_heads, head_dim] holding kv_len int32 [B]
    valid positions: flash_attention with causal_alignment="bottom_right" and
    key_value_seq_lengths, so the cache's unused tail is never seen. With ``page_table``
    (int32 [B, max_pages]) k and v are pages [num_pages, PAGE_SIZE, kv_heads, head_dim]; the
    fused kernels do not read pages yet, so those calls run where implementation=None puts
    them unless "xla" was asked for."""
    if page_table is not None and implementation != "xla":
        implementation = None

    def attend(q, k, v, kv_len):
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        out = flash_attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                              key_value_seq_lengths=kv_len, implementation=implementation,
                              page_table=page_table)
        return out.astype(jnp.float32)

    return attend


PAGE_SIZE = 16  # positions per page of the paged KV cache (``--paged``)


def _write_cache(cache, new, offset, page_table=None):
    """``cache`` with ``new`` [B, T, kv_heads, head_dim] at positions offset..offset+T-1: a
    contiguous cache [B, Tmax, ...], or pages [num_pages, PAGE_SIZE, ...] of the one sequence
    ``page_table`` [1, max_pages] names."""
    if page_table is None:
        return jax.lax.dynamic_update_slice_in_dim(cache, new, offset, axis=1)
    pos = offset + jnp.arange(new.shape[1])
    return cache.at[page_table[0, pos // PAGE_SIZE], pos % PAGE_SIZE].set(new[0])


def forward(params: dict, tokens, cfg: Config, attend, *, cache_attend=None, cache=None,
            offset=0, page_table=None):
    """Logits [B, T, 256] float32 for byte tokens int32 [B, T].

    Without ``cache``: the tokens are positions 0..T-1, attention ``attend(q, k, v)``. With
    ``cache`` (one (k, v) pair [B, Tmax, kv_heads, head_dim] per layer) the tokens are positions
    offset..offset+T-1: their k, v are written into the cache there and the queries attend to
    the first offset + T cached positions through ``cache_attend(q, k, v, kv_len)``. Returns
    (logits, cache) in that case, the updated cache included. With ``page_table`` the cache
    holds pages (``_write_cache``).
    """
    x = params["embed"][tokens]
    b, t, _ = x.shape
    new_cache = []
    for n, layer in enumerate(params["layers"]):
        q, k, v = qkv(layer, x, cfg, offset)
        if cache is None:
            attended = attend(q, k, v)
        else:
            k = _write_cache(cache[n][0], k, offset, page_table)
            v = _write_cache(cache[n][1], v, offset, page_table)
            new_cache.append((k, v))
            attended = cache_attend(q, k, v, jnp.full((b,), offset + t, jnp.int32))
        x = x + attended.reshape(b, t, -1) @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + jax.nn.gelu(h @ layer["w1"]) @ layer["w2"]
    logits = rms_norm(x, params["final_norm"]) @ params["embed"].T
    return logits if cache is None else (logits, new_cache)


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


def parse_mesh(text: str | None) -> dict[str, int]:
    """"data=2,sp=2" -> {"data": 2, "sp": 2} (an axis left out has size 1)."""
    sizes = {"data": 1, "sp": 1}
    for part in filter(None, (text or "").split(",")):
        name, _, size = part.partition("=")
        if name not in sizes or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh takes data=N,sp=M (positive sizes), got {text!r}")
        sizes[name] = int(size)
    return sizes


def make_mesh(sizes: dict[str, int]) -> Mesh:
    """The ("data", "sp") mesh over every device of every process, on the default device's
    platform (the CPU where the emulator runs on a GPU machine)."""
    devices = jax.devices(default_device().platform)
    if len(devices) != sizes["data"] * sizes["sp"]:
        raise SystemExit(f"--mesh data={sizes['data']},sp={sizes['sp']} needs "
                         f"{sizes['data'] * sizes['sp']} devices, JAX has {len(devices)}")
    return Mesh(np.array(devices).reshape(sizes["data"], sizes["sp"]), ("data", "sp"))


def _placer(mesh):
    """x -> jax.Array: the same global NumPy array on every process, laid out over ``mesh``
    (tokens [B, T] split as "data", "sp"; everything else replicated); identity without one."""
    if mesh is None:
        return lambda x, spec=None: x

    def place(x, spec=P()):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda index: x[index])
    return place


def train(cfg: Config, data: np.ndarray, implementation: str | None, *, seed: int = 0,
          progress: bool = True, mesh=None):
    """Train from scratch on the uint8 byte array ``data``; returns (params, per-step losses).
    With a ``mesh`` ("data", "sp"; ``make_mesh``, any number of processes) the step is data-
    and sequence-parallel: the same global batches, parameters replicated."""
    attend = make_attention(implementation, cfg.attn_dtype, mesh=mesh)
    optimizer = make_optimizer(cfg)
    place = _placer(mesh)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets, cfg, attend)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree_util.tree_map(place, init_params(cfg, jax.random.PRNGKey(seed)))
    opt_state = jax.jit(optimizer.init)(params)
    rng = np.random.default_rng(seed)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    losses = []
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=not progress)
    start = None  # timing starts after step 1, which includes compilation
    for i in bar:
        batch = windows(data, rng, cfg.batch_size, cfg.seq_len)
        params, opt_state, loss = step(params, opt_state,
                                       *(place(x, P("data", "sp")) for x in batch))
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


def _context_start(start: int, length: int, cfg: Config) -> int:
    """Where the model's context begins once the text is ``length`` bytes long: it keeps
    growing from ``start`` up to seq_len bytes, then restarts from the last seq_len // 2."""
    return length - cfg.seq_len // 2 if length - start > cfg.seq_len else start


def _pick(logits, key, temperature):
    if temperature > 0:
        return jax.random.categorical(key, logits / temperature)
    return jnp.argmax(logits)


def generate(params, cfg: Config, implementation: str | None, prompt: bytes, length: int, *,
             temperature: float = 0.8, seed: int = 0, cache: bool = True,
             paged: bool = False) -> bytes:
    """Continue ``prompt`` by ``length`` bytes. ``temperature`` 0 means greedy.

    The context grows to ``seq_len`` bytes and then restarts from its last ``seq_len // 2``
    (positions from 0 again). With ``cache`` (the default) each context is run once (a prefill
    of seq_len padded positions, causal attention making the padding invisible) into a KV cache
    of seq_len positions per layer, and every new byte is one jit-compiled step: the new token's
    k, v are appended and its query attends to the cache, one flash_attention call per layer
    with causal_alignment="bottom_right" and key_value_seq_lengths. Without ``cache`` every byte
    recomputes the whole context (the reference the cached sampler must reproduce exactly).
    With ``paged`` the cache is a pool of pages of PAGE_SIZE positions (one spare) handed out
    in shuffled order and read through flash_attention's page_table; the bytes are the same.
    Prints nothing; ``generate_timed`` reports tokens/s.
    """
    return generate_timed(params, cfg, implementation, prompt, length, temperature=temperature,
                          seed=seed, cache=cache, paged=paged)[0]


def generate_timed(params, cfg: Config, implementation: str | None, prompt: bytes, length: int,
                   *, temperature: float = 0.8, seed: int = 0,
                   cache: bool = True, paged: bool = False) -> tuple[bytes, float]:
    """``generate`` and its sampling rate in bytes (tokens) per second, timed from the second
    byte on (the first includes compilation; nan when fewer than 2 bytes are sampled)."""
    if not prompt:
        raise ValueError("the prompt must not be empty")
    attend = make_attention(implementation, cfg.attn_dtype)
    hd, n = cfg.head_dim, cfg.seq_len
    page_table = None
    if paged:
        max_pages = -(-n // PAGE_SIZE)
        pool = np.random.default_rng(seed).permutation(max_pages + 1)  # one page spare
        page_table = jnp.asarray(pool[None, :max_pages], jnp.int32)
    cache_attend = make_cached_attention(implementation, cfg.attn_dtype, page_table)

    def padded(tokens):
        window = np.zeros(n, np.int32)
        window[: len(tokens)] = tokens
        return window

    @jax.jit
    def recompute(params, window, pos, key):
        return _pick(forward(params, window[None], cfg, attend)[0, pos], key, temperature)

    @jax.jit
    def prefill(params, window, pos, key):
        shape = (1, n) if page_table is None else (page_table.shape[1] + 1, PAGE_SIZE)
        empty = [(jnp.zeros(shape + (cfg.kv_heads, hd)), jnp.zeros(shape + (cfg.kv_heads, hd)))
                 for _ in params["layers"]]
        logits, kv = forward(params, window[None], cfg, attend, cache_attend=cache_attend,
                             cache=empty, offset=0, page_table=page_table)
        return _pick(logits[0, pos], key, temperature), kv

    @jax.jit
    def step(params, kv, token, pos, key):
        logits, kv = forward(params, token.reshape(1, 1), cfg, attend, cache_attend=cache_attend,
                             cache=kv, offset=pos, page_table=page_table)
        return _pick(logits[0, 0], key, temperature), kv

    out = list(prompt)
    start = _context_start(0, len(out), cfg)
    key = jax.random.PRNGKey(seed)
    kv = None
    t0 = time.perf_counter()  # restarted after the first byte, which pays the compiles
    for i in range(length):
        if i == 1:
            t0 = time.perf_counter()
        key, sub = jax.random.split(key)
        restart = _context_start(start, len(out), cfg)
        context = out[restart:]
        if not cache:
            token = recompute(params, padded(context), len(context) - 1, sub)
        elif kv is None or restart != start:
            token, kv = prefill(params, padded(context), len(context) - 1, sub)
        else:  # the newest byte out[-1] is position len(context) - 1 of the cache
            token, kv = step(params, kv, jnp.int32(out[-1]), jnp.int32(len(context) - 1), sub)
        start = restart
        out.append(int(token))
    rate = (length - 1) / (time.perf_counter() - t0) if length > 1 else float("nan")
    return bytes(out), rate


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
    p.add_argument("--max-bytes", type=int, default=1 << 20, help="corpus size cap in bytes")
    p.add_argument("--implementation", choices=["xla", "emulator", "metal"], default=None,
                   help=implementation_help)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash_metal.examples.train_lm",
        description="Train a byte-level transformer LM whose attention is flash_attention.",
        formatter_class=HelpFormatter)
    add_common_args(p, "flash_attention implementation (default: the package's default, i.e. "
                       "metal when available, else xla; the emulator is slow by design and "
                       "switches to the tiny configuration)")
    p.add_argument("--tiny", action="store_true", help="use the tiny configuration")
    for name, typ in (("steps", int), ("batch-size", int), ("seq-len", int), ("layers", int),
                      ("d-model", int), ("heads", int), ("kv-heads", int), ("head-dim", int),
                      ("lr", float), ("warmup", int)):
        p.add_argument(f"--{name}", type=typ, default=None,
                       help=f"override the configuration's {name.replace('-', '_')} (default: "
                            "the configuration's)")
    p.add_argument("--attn-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="dtype of q/k/v given to flash_attention (default: float32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    p.add_argument("--prompt", default="def ", help="start of the generated sample")
    p.add_argument("--sample-bytes", type=int, default=None,
                   help="length of the generated sample (default: 300, 60 for the tiny config)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature, 0 = greedy")
    p.add_argument("--paged", action="store_true",
                   help="sample with a paged KV cache (pages of 16 positions in shuffled order, "
                        "flash_attention's page_table; the same bytes as the contiguous cache)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--mesh", default=None,
                   help="data- and sequence-parallel training over every device of every "
                        "process, e.g. data=2,sp=2 (batch over data, ring attention over sp); "
                        "prints the losses and stops after training")
    p.add_argument("--coordinator", default=None,
                   help="host:port of process 0: jax.distributed.initialize with "
                        "--num-processes and --process-id (CPU collectives: gloo)")
    p.add_argument("--num-processes", type=int, default=1,
                   help="processes taking part, with --coordinator")
    p.add_argument("--process-id", type=int, default=0,
                   help="this process's index in [0, --num-processes), with --coordinator")
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
    if args.coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    try:
        if args.implementation == "emulator":
            emulator_on_the_host()  # an FFI call on the host: it lowers for "cpu" only
        resolved = dispatch.resolve(args.implementation, default_device().platform)
    except (ValueError, NotImplementedError) as e:
        raise SystemExit(f"error: {e}") from None
    tiny = args.tiny or resolved == "emulator"
    cfg = config_from_args(args, tiny)
    print(f"jax_flash_metal {jax_flash_metal.__version__}, jax {jax.__version__}, backend "
          f"{default_device().platform}; attention implementation: {resolved} "
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
    print(f"model: {count(cfg.layers, 'layer')}, d_model {cfg.d_model}, {cfg.heads} query / "
          f"{count(cfg.kv_heads, 'kv head')} of dim {cfg.head_dim}, {n_params / 1e6:.2f} M "
          f"parameters; attention in {cfg.attn_dtype}")
    print(f"training: {count(cfg.steps, 'step')} of {cfg.batch_size} x {cfg.seq_len} bytes, "
          f"AdamW lr "
          f"{cfg.lr:g} (warmup {cfg.warmup}, cosine)")

    if args.mesh is not None:
        return train_parallel(cfg, train_data, resolved, args)
    evaluate = make_evaluator(cfg, resolved)
    initial_eval = evaluate(init_params(cfg, jax.random.PRNGKey(args.seed)), held_out)
    t0 = time.perf_counter()
    params, losses = train(cfg, train_data, resolved, seed=args.seed, progress=not args.no_progress)
    seconds = time.perf_counter() - t0
    final_eval = evaluate(params, held_out)
    end = float(np.mean(losses[-10:]))
    print(f"loss (nats/byte): start {losses[0]:.3f} -> end {end:.3f} (mean of the last "
          f"{count(min(10, len(losses)), 'step')}); held-out {initial_eval:.3f} -> "
          f"{final_eval:.3f} "
          f"({final_eval / math.log(2):.2f} bits/byte); {seconds:.1f} s")

    length = args.sample_bytes if args.sample_bytes is not None else (60 if tiny else 300)
    sample, rate = generate_timed(params, cfg, resolved, args.prompt.encode(), length,
                                  temperature=args.temperature, seed=args.seed,
                                  paged=args.paged)
    print(f"sample (temperature {args.temperature:g}; {'paged ' if args.paged else ''}KV-cache "
          f"sampling, one flash_attention call per layer and byte: {rate:,.1f} tokens/s):")
    print("-" * 72)
    print(sample.decode("utf-8", errors="replace"))
    print("-" * 72)

    check = gradient_check(params, cfg, held_out, resolved)
    print(f"gradient check on one batch, layer-0 attention, flash_attention[{resolved}] vs "
          f"reference_attention: max |diff| dq {check['dq']:.2e}, dk {check['dk']:.2e}, "
          f"dv {check['dv']:.2e} (largest gradient entry {check['scale']:.2e})")
    return {"losses": losses, "initial_eval": initial_eval, "final_eval": final_eval,
            "sample": sample, "sample_tokens_per_second": rate, "check": check,
            "implementation": resolved}


def train_parallel(cfg: Config, data: np.ndarray, implementation: str, args) -> dict:
    """``main``'s --mesh run: train over the mesh and print every step's loss."""
    sizes = parse_mesh(args.mesh)
    mesh = make_mesh(sizes)
    print(f"mesh: data={sizes['data']}, sp={sizes['sp']} over "
          f"{count(jax.device_count(), 'device')} in "
          f"{count(jax.process_count(), 'process', 'processes')} "
          f"(this is process {jax.process_index()})")
    t0 = time.perf_counter()
    _, losses = train(cfg, data, implementation, seed=args.seed, progress=False, mesh=mesh)
    print(f"losses: {' '.join(repr(x) for x in losses)}")
    print(f"{time.perf_counter() - t0:.1f} s")
    return {"losses": losses, "implementation": implementation}


if __name__ == "__main__":
    main(sys.argv[1:])
