"""Every option of every command-line tool (the ``python -m`` modules and benchmarks/*.py) has
--help text; a flag two of them take is defined once, in one form (tools/cli.FLAGS)."""

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


# The programs that share the problem flags: the package's, and the scripts using its CLI helpers.
PROBLEM_PROGRAMS = ["jax_flash_metal.benchmark", "jax_flash_metal.profile",
                    "jax_flash_metal.selfcheck", "jax_flash_metal.tune"] + [
    s for s in SCRIPTS if "jax_flash_metal.tools.cli" in open(os.path.join(ROOT, s)).read()]
# Same spelling, meant differently: each program writes its own JSON report; the many-GPU
# benchmark takes any implementation (xla too) and flash_attention's chain by default.
OWN_FORM = {"--help", "--json", ("benchmarks/multi_gpu.py", "--implementation")}


def _parser(tool, monkeypatch):
    if tool in MODULES:
        return _parser_of(lambda: runpy.run_module(tool, run_name="__main__"), monkeypatch)
    return _parser_of(lambda: runpy.run_path(os.path.join(ROOT, tool), run_name="__main__"),
                      monkeypatch)


def _form(action):
    return (type(action).__name__, action.option_strings, action.nargs, action.const,
            action.choices and list(action.choices), action.type, action.metavar)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, harmless
def test_shared_flags_are_defined_once(monkeypatch):
    """A flag two of the programs take is the one in tools/cli.FLAGS, in that one form (option
    strings, nargs, choices, type), in every program."""
    pytest.importorskip("jax_flash_metal._ext", reason="the self-check reads the extension")
    from jax_flash_metal.tools import cli

    takers: dict[str, list[str]] = {}
    for tool in PROBLEM_PROGRAMS:
        for action in _parser(tool, monkeypatch)._actions:
            own = [o for o in action.option_strings if o in OWN_FORM or (tool, o) in OWN_FORM]
            if own:
                continue
            assert action.dest in cli.FLAGS or not set(action.option_strings) & {
                o for options, _ in cli.FLAGS.values() for o in options}, (tool, action.dest)
            if action.dest in cli.FLAGS:
                shared = argparse.ArgumentParser()
                cli.add_flags(shared, **{action.dest: action.default})
                assert _form(action) == _form(shared._actions[-1]), (tool, action.dest)
            for option in action.option_strings:
                takers.setdefault(option, []).append(tool)
    twice = {o: t for o, t in takers.items() if len(t) > 1}
    strays = {o: t for o, t in twice.items()
              if not any(o in options for options, _ in cli.FLAGS.values())}
    assert not strays, f"flags defined in two programs, not once in tools/cli.FLAGS: {strays}"
    assert {"--dtype", "--causal", "--head-dim", "--heads", "--repeats"} <= set(twice)


def test_causal_is_off_on_or_both_and_bare_means_on():
    from jax_flash_metal.tools import cli

    parser = argparse.ArgumentParser()
    cli.add_flags(parser, causal="off")
    runs = [cli.CAUSAL[parser.parse_args(argv).causal]
            for argv in ([], ["--causal"], ["--causal", "both"], ["--causal", "on"])]
    assert runs == [(False,), (True,), (False, True), (True,)]
    with pytest.raises(SystemExit):
        parser.parse_args(["--causal", "yes"])
