"""Optional dependencies (pyproject.toml's extras): an ImportError that names the extra to
install instead of a bare ``ModuleNotFoundError``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# No release is published: the package installs from a clone (or a wheel built from one).
INSTALL_HINT = ('from a clone of jax_flash_metal: pip install ".[{extra}]" (or, for a wheel '
                'built with `pip wheel .`, pip install "<that wheel file>[{extra}]")')


def install_hint(extra: str) -> str:
    """How to install the ``extra`` (docs/development.md says how to build a wheel)."""
    return INSTALL_HINT.format(extra=extra)


@contextlib.contextmanager
def needs(extra: str, user: str, modules: tuple[str, ...]) -> Iterator[None]:
    """Around the imports of ``user``: a missing top-level module of ``modules`` raises
    ImportError naming ``extra``; any other import error passes through unchanged."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in modules:
            raise
        raise ImportError(f"{user} needs {missing}, which is not installed; install the "
                          f"[{extra}] extra, {install_hint(extra)}", name=e.name) from e
