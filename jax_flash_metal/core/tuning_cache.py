"""The autotuner's per-user cache file: which kernel variant won each tuned key
(docs/tuning.md#the-cache-file).

The file is ``$JFM_TUNE_CACHE`` when set, else ``jax_flash_metal/tuning.json`` in the platform's
per-user cache directory: ``~/Library/Caches`` on macOS, ``$XDG_CACHE_HOME`` or ``~/.cache``
elsewhere (the XDG base directory rule). It is one JSON object, ``{"format": FORMAT,
"entries": {key: entry}}``; a key names everything the choice depends on (``key``), so a new
GPU, macOS or package version simply misses. A file that cannot be read as that object is
ignored with a warning and replaced by the next write. Writes merge with what is on disk under
an advisory lock (``fcntl.flock``, where it exists) and land by ``os.replace`` of a temporary
file, so processes tuning at once leave a valid file holding every entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings

ENV = "JFM_TUNE_CACHE"
FORMAT = "jax_flash_metal tuning cache 1"

try:  # POSIX; elsewhere the os.replace alone keeps the file valid (an entry may be lost)
    import fcntl
except ImportError:  # pragma: no cover - not a supported platform of the extension
    fcntl = None  # type: ignore[assignment]


def path() -> str:
    """The cache file's path (``$JFM_TUNE_CACHE``, else the platform's cache directory)."""
    if os.environ.get(ENV, "").strip():
        return os.path.expanduser(os.environ[ENV].strip())
    home = os.path.expanduser("~")
    if sys.platform == "darwin":
        base = os.path.join(home, "Library", "Caches")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(home, ".cache")
    return os.path.join(base, "jax_flash_metal", "tuning.json")


def key(**fields) -> str:
    """The entry key of ``fields`` (str, int or sequences of them), in the order given:
    ``"gpu=Apple M2 Pro|macos=14.5|..."``."""
    def text(value):
        return "x".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
    return "|".join(f"{name}={text(value)}" for name, value in fields.items())


def _valid_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("variant"), int)
            and not isinstance(entry["variant"], bool) and entry["variant"] >= 0)


def load(file: str | None = None) -> dict[str, dict]:
    """The entries of the cache file ({} when it does not exist). A file that is not this
    format (corrupt, truncated, another program's or another format version's) is ignored
    with a warning naming it; entries without a valid ``variant`` are dropped."""
    file = file or path()
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"jax_flash_metal: ignoring the tuning cache {file}: {e}", stacklevel=2)
        return {}
    if not (isinstance(data, dict) and data.get("format") == FORMAT
            and isinstance(data.get("entries"), dict)):
        warnings.warn(f"jax_flash_metal: ignoring the tuning cache {file}: not a "
                      f"{FORMAT!r} file", stacklevel=2)
        return {}
    entries = {k: e for k, e in data["entries"].items() if _valid_entry(e)}
    if len(entries) < len(data["entries"]):
        warnings.warn(f"jax_flash_metal: the tuning cache {file}: dropped "
                      f"{len(data['entries']) - len(entries)} entries without a valid variant",
                      stacklevel=2)
    return entries


@contextlib.contextmanager
def _locked(file: str):
    if fcntl is None:
        yield
        return
    with open(file + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store(entries: dict[str, dict], file: str | None = None) -> dict[str, dict]:
    """Merge ``entries`` into the cache file (they win over the file's entries of the same
    keys) and return the merged entries. A symbolic link is written through (its target is
    replaced). Raises OSError when the directory cannot be written or the path exists and is
    not a regular file (a directory, a device: never replaced)."""
    file = os.path.realpath(file or path())
    if os.path.exists(file) and not os.path.isfile(file):
        raise OSError(f"{file} exists and is not a regular file")
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    with _locked(file):
        merged = {**load(file), **entries}
        fd, temporary = tempfile.mkstemp(prefix=".tuning-", suffix=".json",
                                         dir=os.path.dirname(os.path.abspath(file)))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"format": FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
            os.replace(temporary, file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    return merged
