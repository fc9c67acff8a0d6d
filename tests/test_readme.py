"""Every fenced code block in README.md is run or explicitly exempt.

- ```python blocks run as written, each in a fresh namespace, and must not raise (they may
  assert);
- ```text blocks are output or listings and are not run;
- any other block (```bash, no language, ...) must be preceded, with at most blank lines in
  between, by a line ``<!-- readme-test: skip (reason) -->``; a python block may be exempted the
  same way.
New blocks are picked up automatically; an unmarked block that cannot run fails
test_every_block_runs_or_is_marked.
"""

import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARKER = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->$")
RUN, OUTPUT = "python", "text"


def readme_blocks(path=README):
    """[(line of the opening fence, language, code, skip reason or None)] of the file."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, reason, i = [], None, 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            start, language = i + 1, line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"README.md:{start}: code block is never closed"
            blocks.append((start, language, "\n".join(lines[i + 1:end]), reason))
            reason, i = None, end + 1
            continue
        match = MARKER.match(line)
        if match:
            reason = match["reason"].strip()
        elif line and reason is not None:
            raise AssertionError(f"README.md:{i + 1}: a readme-test marker must come just "
                                 "before a code block")
        i += 1
    return blocks


BLOCKS = readme_blocks()


def test_every_block_runs_or_is_marked():
    unmarked = [f"README.md:{line}: ```{language}" for line, language, _, reason in BLOCKS
                if reason is None and language not in (RUN, OUTPUT)]
    assert not unmarked, (
        "these README blocks are neither python (run) nor text (output); mark each with "
        "<!-- readme-test: skip (reason) --> or change its language: " + ", ".join(unmarked))
    assert any(language == RUN and reason is None for _, language, _, reason in BLOCKS)


@pytest.mark.parametrize("line,code", [
    pytest.param(line, code, id=f"README.md:{line}") for line, language, code, reason in BLOCKS
    if language == RUN and reason is None])
def test_python_block_runs(line, code):
    # Padded so that tracebacks give README.md's own line numbers.
    exec(compile("\n" * line + code, README, "exec"), {"__name__": "__readme__"})


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
