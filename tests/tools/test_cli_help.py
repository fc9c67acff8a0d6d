"""Every option of every command-line tool (the ``python -m`` modules and benchmarks/*.py) has
--help text."""

import argparse
import glob
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = ["jax_flash_metal.benchmark", "jax_flash_metal.profile", "jax_flash_metal.selfcheck",
           "jax_flash_metal.tune",
           "jax_flash_metal.fused.shader_libraries", "jax_flash_metal.examples.train_lm",
           "jax_flash_metal.examples.train_flax"]
SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks",
                                                                          "*.py")))
NEEDS_EXTENSION = {os.path.join("benchmarks", "emulator_speed.py"),
                   os.path.join("benchmarks", "host_path.py"), "jax_flash_metal.selfcheck",
                   "jax_flash_metal.fused.shader_libraries"}


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(run, monkeypatch):
    """The parser a tool builds: its first parse_args call is stopped and the parser kept."""
    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(_Parsed) as caught:
        run()
    return caught.value.parser


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
@pytest.mark.parametrize("tool", MODULES + SCRIPTS)
def test_every_option_has_help(tool, monkeypatch):
    if tool in NEEDS_EXTENSION:
        pytest.importorskip("jax_flash_metal._ext", reason="the tool reads the extension")
    if tool in MODULES:
        parser = _parser_of(lambda: runpy.run_module(tool, run_name="__main__"), monkeypatch)
    else:
        parser = _parser_of(lambda: runpy.run_path(os.path.join(ROOT, tool),
                                                   run_name="__main__"), monkeypatch)
    missing = [a.option_strings or a.dest for a in parser._actions
               if not isinstance(a, argparse._HelpAction)
               and (not a.help or a.help == argparse.SUPPRESS)]
    assert not missing, f"{tool}: options without --help text: {missing}"
    assert parser.description, f"{tool}: no description"
