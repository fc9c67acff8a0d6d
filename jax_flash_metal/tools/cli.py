"""What the command-line tools share: --help with every default shown, every flag two programs
take (defined once, in one form), a progress bar, and plain-text tables that fit 100 columns."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax
import jax.numpy as jnp

from .. import implementations


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None, whose meaning the help text gives (argparse
    would print "(default: None)")."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def positive_int(text):
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


DTYPES = ("float32", "float16", "bfloat16")
# --causal's settings, each the masks it runs (a bare --causal is "on").
CAUSAL = {"off": (False,), "on": (True,), "both": (False, True)}
IMPLEMENTATIONS = ("metal", "emulator")

# Every flag that two or more programs take, in its one form: (option strings, argparse keywords
# less the default, which is each program's). Lists are space-separated (nargs="+").
FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "batch": (("--batch",), dict(type=positive_int, help="batch size")),
    "heads": (("--heads",), dict(type=positive_int, help="query heads")),
    "kv_heads": (("--kv-heads",), dict(
        type=positive_int, help="key/value heads, dividing the query heads (grouped-query "
                                "attention)")),
    "dtype": (("--dtype",), dict(nargs="+", choices=DTYPES, metavar="DTYPE",
                                 help=f"input dtype(s) ({', '.join(DTYPES)}), each run in turn")),
    "causal": (("--causal",), dict(nargs="?", const="on", choices=tuple(CAUSAL),
                                   help="causal masking off, on (a bare --causal) or both, each "
                                        "run in turn")),
    "head_dim": (("--head-dim", "--head-dims"), dict(nargs="+", type=positive_int, metavar="D",
                                                     help="head dim(s) D of query and key")),
    "value_head_dim": (("--value-head-dim",), dict(
        type=positive_int, help="head dim of value (and O)")),
    "q_len": (("--q-len",), dict(type=positive_int, help="query length")),
    "kv_len": (("--kv-len",), dict(type=positive_int, help="key/value length")),
    "seq_len": (("--seq-len",), dict(type=positive_int,
                                     help="sequence length (query = key/value length)")),
    "lengths": (("--lengths", "--seq-lens"), dict(nargs="+", type=positive_int, metavar="N",
                                                  help="sequence lengths, each run in turn")),
    "rounds": (("--rounds",), dict(type=positive_int, help="measured rounds")),
    "implementation": (("--implementation",), dict(
        choices=IMPLEMENTATIONS, help="fused implementation (default: metal where available, "
                                      "else emulator)")),
    "repeats": (("--repeats",), dict(type=positive_int,
                                     help="timed runs of each measurement; the median is kept")),
    "no_progress": (("--no-progress",), dict(action="store_true", help="no progress bar")),
}


def add_flags(parser: argparse.ArgumentParser, notes: dict[str, str] | None = None,
              **defaults) -> None:
    """Adds the shared ``FLAGS`` named by ``defaults`` (dest: the program's default), each in
    its one form; ``notes`` appends a program's remark to a flag's help, in parentheses."""
    for dest, default in defaults.items():
        options, form = FLAGS[dest]
        note = (notes or {}).get(dest)
        form = dict(form, help=f"{form['help']} ({note})") if note else form
        parser.add_argument(*options, dest=dest, default=default, **form)


def add_problem_flags(parser: argparse.ArgumentParser, *, heads: int,
                      kv_heads: int | None = None) -> None:
    """The problem flags of the benchmarks and the profile: --batch, --heads (default
    ``heads``, the program's), --kv-heads (default ``kv_heads``; None: --heads) and
    --no-progress. ``check_problem_flags`` completes them after parsing."""
    add_flags(parser, notes=None if kv_heads else dict(kv_heads="default: --heads"), batch=1,
              heads=heads, kv_heads=kv_heads, no_progress=False)


def check_problem_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kv-heads defaulted to --heads; a parser error when it does not divide --heads."""
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")


def default_implementation() -> str:
    """The fused implementation a program runs unless told: metal where available, else the
    emulator."""
    return "metal" if "metal" in implementations.available() else "emulator"


def check_implementation(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--implementation defaulted to metal where available, else emulator; a parser error
    when the one named is not available here. The emulator's programs compute on the host
    (``emulator_on_the_host``)."""
    if args.implementation is None:
        args.implementation = default_implementation()
    if args.implementation not in implementations.available():
        parser.error(f"--implementation {args.implementation} is not available here: "
                     f"{implementations.unavailable_reasons().get(args.implementation, '')}")
    if args.implementation == "emulator":
        emulator_on_the_host()


def emulator_on_the_host() -> None:
    """Make the CPU device the program's default device where an accelerator is (a machine with
    an NVIDIA GPU): the emulator is an FFI call on the host and lowers only for "cpu"."""
    if jax.default_backend() != "cpu":
        jax.config.update("jax_default_device", jax.devices("cpu")[0])


def default_device():
    """The device new arrays go to: ``jax_default_device`` where set, else the default
    backend's first."""
    device = jax.config.jax_default_device
    if device is None or isinstance(device, str):  # unset, or a platform's name
        return jax.devices(device)[0]
    return device


def operand_shape(shape, dtype) -> jax.ShapeDtypeStruct:
    """An abstract operand on ``default_device()``: lowering one without a sharding targets
    the default backend, not ``emulator_on_the_host``'s device."""
    # The newest JAX deprecates the class for the factory; older releases have only the class.
    single = (getattr(jax.sharding, "make_single_device_sharding", None)
              or jax.sharding.SingleDeviceSharding)
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=single(default_device()))


class _Lines:
    """The stand-in for tqdm where it is not installed: one "done/total" line per step."""

    def __init__(self, total, desc, enabled):
        self.total, self.n, self.desc, self.enabled = total, 0, desc, enabled
        if enabled:
            print(f"{desc}: no progress bar (pip install tqdm for one with an ETA)",
                  file=sys.stderr)

    def update(self, n=1):
        self.n += n
        if self.enabled:
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text):
        pass

    def write(self, text, file=sys.stderr):
        print(text, file=file)

    def close(self):
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A tqdm bar on stderr (done/total, rate and ETA); without tqdm, plain "done/total" lines;
    nothing when not ``enabled``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(total, desc, enabled)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=not enabled)


# Printed tables are split to fit this many characters a line (split_columns).
WIDTH = 100


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` with the number agreeing: "1 layer", "2 layers", "0 layers"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def aligned(header: list[str], body: list[list[str]], left: int = 1) -> str:
    """A plain-text table: the first ``left`` columns left-aligned, the others right-aligned,
    every column as wide as its widest cell ("-" cells included), a dashed rule under the
    header."""
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(c) for c in body])


def split_columns(header: list[str], body: list[list[str]], keys: int,
                  width: int) -> list[tuple[list[str], list[list[str]]]]:
    """(header, body) parts of a table whose ``aligned`` lines fit ``width`` characters: each
    part has the first ``keys`` columns, then as many of the others, in order, as fit (at least
    one)."""
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    parts: list[tuple[list[str], list[list[str]]]] = []
    start = keys
    while start < len(header) or not parts:
        used, end = sum(widths[:keys]) + 2 * (keys - 1), start
        while end < len(header) and (end == start or used + 2 + widths[end] <= width):
            used += 2 + widths[end]
            end += 1
        columns = list(range(keys)) + list(range(start, end))
        parts.append(([header[i] for i in columns], [[line[i] for i in columns] for line in body]))
        start = end
    return parts
