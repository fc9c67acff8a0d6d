"""Every fenced code block in README.md and docs/*.md is run or explicitly exempt.

- ```python blocks run as written, each in a fresh namespace, and must not raise (they may
  assert); a block showing ``jax.set_mesh`` is skipped on a JAX without it;
- ```text blocks are output or listings and are not run;
- any other block (```bash, no language, ...) must be preceded, with at most blank lines in
  between, by a line ``<!-- readme-test: skip (reason) -->``; a python block may be exempted the
  same way.
New blocks are picked up automatically; an unmarked block that cannot run fails
test_every_block_runs_or_is_marked.
"""

import os
import re

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
RUN, OUTPUT = "python", "text"


def readme_blocks(path=README):
    """[(line of the opening fence, language, code, skip reason or None)] of the file."""
    name = os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, reason, i = [], None, 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            start, language = i + 1, line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{name}:{start}: code block is never closed"
            blocks.append((start, language, "\n".join(lines[i + 1:end]), reason))
            reason, i = None, end + 1
            continue
        match = MARKER.match(line)
        if match:
            reason = match["reason"].strip()
        elif line and reason is not None:
            raise AssertionError(f"{name}:{i + 1}: a readme-test marker must come just "
                                 "before a code block")
        i += 1
    return blocks


# (page, line, language, code, skip reason) of every block of every page.
BLOCKS = [(os.path.relpath(p, ROOT), *b) for p in PAGES for b in readme_blocks(p)]


def test_every_block_runs_or_is_marked():
    unmarked = [f"{page}:{line}: ```{language}" for page, line, language, _, reason in BLOCKS
                if reason is None and language not in (RUN, OUTPUT)]
    assert not unmarked, (
        "these blocks are neither python (run) nor text (output); mark each with "
        "<!-- readme-test: skip (reason) --> or change its language: " + ", ".join(unmarked))
    assert any(language == RUN and reason is None
               for page, _, language, _, reason in BLOCKS if page == "README.md")


@pytest.mark.parametrize("page,line,code", [
    pytest.param(page, line, code, id=f"{page}:{line}")
    for page, line, language, code, reason in BLOCKS if language == RUN and reason is None])
def test_python_block_runs(page, line, code):
    if "jax.set_mesh" in code and not hasattr(jax, "set_mesh"):  # jax < 0.7
        pytest.skip("the block shows jax.set_mesh, which this JAX does not have")
    # Padded so that tracebacks give the page's own line numbers.
    exec(compile("\n" * line + code, os.path.join(ROOT, page), "exec"), {"__name__": "__readme__"})


def test_markers_and_languages_are_read(tmp_path):
    sample = tmp_path / "README.md"
    sample.write_text("intro\n\n<!-- readme-test: skip (installs) -->\n\n```bash\npip install x\n"
                      "```\n\n```python\nprint(1)\n```\n\n```\nraw\n```\n", encoding="utf-8")
    assert readme_blocks(str(sample)) == [(5, "bash", "pip install x", "installs"),
                                          (9, "python", "print(1)", None),
                                          (13, "", "raw", None)]
    sample.write_text("<!-- readme-test: skip (why) -->\nprose\n```python\n```\n",
                      encoding="utf-8")
    with pytest.raises(AssertionError, match="README.md:2: a readme-test marker"):
        readme_blocks(str(sample))


# ---- output blocks: what the current code prints ---------------------------------------------

def _text_blocks(prefix):
    return [(f"{page}:{line}", code) for page, line, language, code, _ in BLOCKS
            if language == OUTPUT and code.lstrip().startswith(prefix)]


def _cells(line):
    return re.split(r" {2,}", line.strip())


def _skeleton(text):
    """The lines of a profile table with each kernel row reduced to its kernel name (the
    counts depend on the shape; the names, titles and headers do not, nor, with the columns
    as wide as their widest cell, does more than the spacing of the headers and rules)."""
    return [line.split()[0] if line.startswith("flash_attention_")
            else " ".join("-" if set(word) == {"-"} else word for word in line.split())
            for line in text.strip("\n").splitlines()]


PROFILE_BLOCKS = _text_blocks("$ python -m jax_flash_metal.profile")


def test_docs_have_a_profile_block():
    assert PROFILE_BLOCKS


@pytest.mark.parametrize("line,code", [pytest.param(*b, id=b[0]) for b in PROFILE_BLOCKS])
def test_profile_block_is_current(line, code, capsys):
    """The block's command, rerun at length 32: the same kernels in the same order, and the
    same titles and column headers (the counts themselves depend on the length)."""
    import shlex

    from jax_flash_metal import profile
    from jax_flash_metal.tools import profile_model
    emulator = pytest.importorskip("jax_flash_metal._ext").emulator
    if not emulator.has_counting_variant():
        pytest.skip(profile_model.NO_COUNTING_MESSAGE)
    command, output = code.split("\n", 1)
    argv = shlex.split(command.split("#")[0])[4:]  # after "$ python -m jax_flash_metal.profile"
    assert profile.main(argv + ["--q-len", "32", "--no-progress"]) == 0
    assert _skeleton(output) == _skeleton(capsys.readouterr().out)


def _benchmark_tables(code):
    """(header line, rule line, row lines) of each table in a benchmark output block."""
    lines, tables = code.splitlines(), []
    for i in range(1, len(lines)):
        if re.fullmatch(r"-+( +-+)*", lines[i]):
            end = next((j for j in range(i + 1, len(lines)) if not lines[j].strip()), len(lines))
            tables.append((lines[i - 1], lines[i], lines[i + 1:end]))
    return tables


BENCHMARK_BLOCKS = [(f"{page}:{line}", code) for page, line, language, code, _ in BLOCKS
                    if language == OUTPUT and re.search(
                        r"^method .* fwd ms|/ jax\.nn \(forward\+backward", code, re.M)]


def test_docs_have_benchmark_blocks():
    assert BENCHMARK_BLOCKS


@pytest.mark.parametrize("line,code", [pytest.param(*b, id=b[0]) for b in BENCHMARK_BLOCKS])
def test_benchmark_block_is_current(line, code):
    """Each table of the block is what the benchmark's formatter prints for its cells: the
    current column names (a subset of the benchmark's, in its order), aligned the current way;
    and a ratio table has the ratio title and columns."""
    from jax_flash_metal.tools import benchmark_tables
    tables = _benchmark_tables(code)
    assert tables, "a benchmark block without a dashed rule under its header"
    for header, rule, rows in tables:
        names = _cells(header)
        if names[0] == "seq":  # the ratio table
            assert names == ["seq", "hdim", "causal", "time", "compile", "temp"]
            title = code.splitlines()[code.splitlines().index(header) - 1]
            assert re.fullmatch(r"\S+ / jax\.nn \(forward\+backward; < 1 means \S+ is "
                                r"faster/smaller\):", title), title
            left = 0
        else:
            columns = list(benchmark_tables.COLUMNS)
            assert names == sorted(names, key=columns.index), names  # raises if one is unknown
            left = 1
        body = [_cells(r) for r in rows]
        text = benchmark_tables.aligned(names, body, left=left)
        assert text.splitlines() == [header, rule, *rows]
