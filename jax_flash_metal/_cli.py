"""What the command-line tools share: --help with every default shown, and a progress bar."""

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


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` with the number agreeing: "1 layer", "2 layers", "0 layers"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
