"""`forerun --help` and every subcommand's help (issue #21): each option says what it does and its real default."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from forerun.config import EngineConfig
from forerun.entrypoints.cli import build_parser, main

_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                    if f.default is not dataclasses.MISSING}


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
             ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(argv path, parser) for the top parser and every subparser below it, nested bench ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, path + (name,))


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if not isinstance(action, argparse._HelpAction):
            yield action


def _expanded_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text as printed (with %(default)s and %(choices)s filled in), on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split())


PARSERS = list(_parsers(build_parser()))
IDS = [" ".join(path) or "forerun" for path, _ in PARSERS]


def test_the_tree_has_every_subcommand():
    assert {" ".join(path) for path, _ in PARSERS} >= {
        "", "generate", "chat", "serve", "bench", "bench throughput", "bench serve", "bench embed"}


@pytest.mark.parametrize(("path", "parser"), PARSERS, ids=IDS)
def test_every_option_has_help_that_shows_its_default(path, parser):
    where = " ".join(("forerun", *path))
    for action in _options(parser):
        name = f"{where} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), f"{name}: no help"
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # the one-line summaries listed under the parent
                assert choice.help and choice.help.strip(), f"{name} {choice.dest}: no summary"
        text = _expanded_help(parser, action)
        if action.option_strings:
            assert "(default: " in text, f"{name}: the help does not state the default"
        assert "default: None" not in text, f"{name}: shows None instead of the effective default"
        default = action.default
        if (isinstance(default, (int, float, str)) and not isinstance(default, bool)
                and default is not argparse.SUPPRESS and action.option_strings):
            # A concrete argparse default is printed as it is (never restated by hand, where it could drift).
            assert f"default: {default}" in text, f"{name}: help says {text!r}, the default is {default!r}"


ENGINE_COMMANDS = [("generate",), ("chat",), ("serve",), ("bench", "throughput")]


def _shown(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("path", ENGINE_COMMANDS, ids=" ".join)
def test_engine_flags_show_the_engine_config_defaults(path):
    """Engine flags default to None so EngineConfig decides; the help must show what EngineConfig decides."""
    parser = dict(PARSERS)[path]
    group = next(g for g in parser._action_groups if g.title == "engine")
    checked = 0
    for action in group._group_actions:
        assert action.default is None, action.dest  # else the flag would override EngineConfig every time
        effective = _ENGINE_DEFAULTS[action.dest]
        if effective is None:
            continue  # resolved at run time (the model's limit, measured, ...): worded in the help, checked above
        # "(default: 256)", or the value then a gloss: "(default: auto: bfloat16 on CUDA; ...)"
        assert re.search(rf"\(default: {re.escape(_shown(effective))}[):,]", _expanded_help(parser, action)), \
            (action.dest, effective)
        checked += 1
    assert checked >= 14  # every engine flag with a fixed default, not just a few


def test_bench_embed_engine_flags_show_the_engine_config_defaults():
    parser = dict(PARSERS)[("bench", "embed")]
    for dest in ("max_num_batched_tokens", "max_num_seqs"):
        action = next(a for a in parser._actions if a.dest == dest)
        assert action.default is None
        assert f"(default: the engine's, {_ENGINE_DEFAULTS[dest]})" in _expanded_help(parser, action)


def test_kv_cache_default_in_the_help_is_the_workers():
    from forerun.worker.worker import DEFAULT_KV_CACHE_BYTES
    generate = dict(PARSERS)[("generate",)]
    action = next(a for a in generate._actions if a.dest == "kv_cache_memory")
    size = re.search(r"default: (\d+)GiB", action.help)
    assert size and int(size.group(1)) << 30 == DEFAULT_KV_CACHE_BYTES


@pytest.mark.parametrize("path", [path for path, _ in PARSERS if path], ids=IDS[1:])
def test_each_subcommand_help_exits_zero(path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*path, "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(f"usage: forerun {' '.join(path)}")
    assert "--log-level LEVEL" in out and "DEBUG, INFO, WARNING, ERROR, CRITICAL (default: WARNING)" in out


def test_forerun_help_in_a_fresh_process():
    res = subprocess.run([sys.executable, "-m", "forerun.entrypoints.cli", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    for command in ("generate", "chat", "serve", "bench"):
        assert f" {command} " in text
    assert "--log-level LEVEL" in text and "(default: WARNING)" in text
