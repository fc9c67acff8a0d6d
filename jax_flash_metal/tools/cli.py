"""What the command-line tools share: --help with every default shown, the problem flags of the
benchmark and the profile, a progress bar, and plain-text tables that fit 100 columns."""

from __future__ import annotations

import argparse
import sys


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


def add_problem_flags(parser: argparse.ArgumentParser, *, heads: int) -> None:
    """The flags the benchmark and the profile share, defined once: --batch, --heads (default
    ``heads``, the program's), --kv-heads (default: --heads) and --no-progress.
    ``check_problem_flags`` completes them after parsing."""
    parser.add_argument("--batch", type=positive_int, default=1, help="batch size")
    parser.add_argument("--heads", type=positive_int, default=heads, help="query heads")
    parser.add_argument("--kv-heads", type=positive_int, default=None,
                        help="key/value heads, dividing --heads (grouped-query attention) "
                             "(default: --heads)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_problem_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--kv-heads defaulted to --heads; a parser error when it does not divide --heads."""
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")


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
