"""docs/parallelism.md's python blocks run as written (on the devices this process has), the
same way README.md's do (tests/test_readme.py)."""

import os

import jax
import pytest

from test_readme import RUN, readme_blocks

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "parallelism.md")
BLOCKS = [(line, code) for line, language, code, reason in readme_blocks(PAGE)
          if language == RUN and reason is None]


def test_page_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="the page shows jax.set_mesh")
@pytest.mark.parametrize("line,code", [pytest.param(*b, id=f"parallelism.md:{b[0]}")
                                       for b in BLOCKS])
def test_python_block_runs(line, code):
    exec(compile("\n" * line + code, PAGE, "exec"), {"__name__": "__doc__"})
