"""The repository documents itself: no file points outside it, and every reference into the
Markdown documentation resolves.

- No tracked file names the design documents or paths of the machine it was written on, or
  an issue tracker's numbers: the design lives in docs/ (docs/README.md).
- Every relative Markdown link (``[text](path#anchor)``) in a tracked ``.md`` file and every
  ``docs/<page>.md#<anchor>`` reference anywhere names an existing file and, where an anchor is
  given, a heading of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces
  as hyphens).
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Written so that this file does not match them itself.
OUTSIDE = {
    "a path into a sibling folder": re.compile(r"\.\./shared"),
    "the former design document": re.compile(r"\bDESIGN\.md"),
    "the former kernel design document": re.compile(r"\bKERNELS\.md"),
    "an absolute path of the development machine": re.compile(r"(?<![\w.])/wor[k]/"),
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d+"),
}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_REFERENCE = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)(?:#([\w-]+))?")


def tracked_files():
    """Repository-relative paths of the tracked files (every file that .gitignore does not
    ignore when this is not a git checkout, e.g. an exported source tree after a test run)."""
    if os.path.isdir(os.path.join(ROOT, ".git")) or os.path.isfile(os.path.join(ROOT, ".git")):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True)
        # Files deleted in the work tree but not yet in the index are left out.
        return [p for p in out.stdout.decode().split("\0")
                if p and os.path.isfile(os.path.join(ROOT, p))]
    import pathspec  # git's own matching rules (negation, anchoring, "dir/" patterns)

    with open(os.path.join(ROOT, ".gitignore")) as f:
        ignored = pathspec.GitIgnoreSpec.from_lines(f)
    paths = []
    for folder, dirs, files in os.walk(ROOT):
        where = os.path.relpath(folder, ROOT).replace(os.sep, "/")
        inside = (lambda name: name) if where == "." else (lambda name: f"{where}/{name}")
        dirs[:] = [d for d in dirs if not ignored.match_file(inside(d) + "/")]
        paths += [inside(f) for f in files if not ignored.match_file(inside(f))]
    return paths


def read_text(path):
    with open(os.path.join(ROOT, path), "rb") as f:
        data = f.read()
    return None if b"\0" in data else data.decode("utf-8", errors="replace")


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    """The anchors of the headings of a Markdown file (outside code blocks)."""
    seen, result, fenced = {}, set(), False
    for line in read_text(path).splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def _check_target(path, anchor, where, problems):
    if not os.path.exists(os.path.join(ROOT, path)):
        problems.append(f"{where}: {path} does not exist")
    elif anchor and (not path.endswith(".md") or anchor not in anchors(path)):
        problems.append(f"{where}: {path} has no section #{anchor}")


FILES = tracked_files()
TEXTS = {p: t for p in FILES if (t := read_text(p)) is not None}


def test_docs_pages_exist():
    for page in ("README.md", "design.md", "kernels.md", "testing.md"):
        assert os.path.join("docs", page) in FILES, page
    assert os.path.join("tests", "README.md") in FILES


@pytest.mark.parametrize("what", sorted(OUTSIDE))
def test_no_file_points_outside_the_repository(what):
    pattern = OUTSIDE[what]
    hits = [f"{path}:{n}: {line.strip()}" for path, text in sorted(TEXTS.items())
            for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not hits, f"{what}:\n" + "\n".join(hits)


def test_markdown_links_resolve():
    problems = []
    for path, text in sorted(TEXTS.items()):
        if not path.endswith(".md"):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) \
                    if file else path
                _check_target(resolved, anchor, f"{path}:{n}", problems)
    assert not problems, "\n".join(problems)


def test_docs_references_resolve():
    problems, count = [], 0
    for path, text in sorted(TEXTS.items()):
        for n, line in enumerate(text.splitlines(), 1):
            for page, anchor in DOCS_REFERENCE.findall(line):
                count += 1
                _check_target(os.path.join("docs", page), anchor, f"{path}:{n}", problems)
    assert count > 20  # the code does point into docs/
    assert not problems, "\n".join(problems)


def test_slug_follows_github():
    assert slug("Decode: split KV") == "decode-split-kv"
    assert slug("Empty rows, padding and non-finite inputs") == \
        "empty-rows-padding-and-non-finite-inputs"
    assert slug("Tiles per family (`tile_shapes.h`)") == "tiles-per-family-tile_shapesh"


def test_layout_page_names_every_file():
    """docs/layout.md's tree has a line for every file of the package, ffi/, emulator/ and
    shaders/ (a subpackage's __init__.py, the emulator's shim and the examples by their folder),
    and for every test folder; and every path it names exists."""
    with open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8") as f:
        tree = f.read().split("```text\n", 1)[1].split("\n```", 1)[0]
    folders, named = [], set()
    for line in tree.splitlines():
        indent = (len(line) - len(line.lstrip())) // 2
        entry = re.split(r"\s{2,}", line.strip())[0]
        folders[indent:] = []
        first, *more = [e.strip() for e in entry.split(",")]
        named.add("".join(folders) + first.rstrip("/"))
        for other in more:  # "dispatch_plan.h, .cc": ".cc" keeps the stem
            stem = first.rsplit(".", 1)[0] if other.startswith(".") else ""
            named.add("".join(folders) + stem + other)
        if first.endswith("/"):
            folders.append(first)
    by_folder = ("emulator/shim", "jax_flash_metal/examples")

    def covered(path):
        folder, name = os.path.split(path)
        return (path in named or folder.startswith(by_folder)
                or (name == "__init__.py" and folder in named))

    files = [p for p in tracked_files()
             if p.split("/")[0] in ("jax_flash_metal", "ffi", "emulator", "shaders")]
    assert [p for p in files if not covered(p)] == []
    tests = {p.split("/")[1] for p in tracked_files()
             if p.startswith("tests/") and p.count("/") >= 2}
    assert sorted(t for t in tests if f"tests/{t}" not in named) == []
    assert sorted(n for n in named if not os.path.exists(os.path.join(ROOT, n))) == []
