"""Every flag of `tandem serve`, `generate`, `bench`, `gateway`, `up` and `nats` says what it does and its default."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import build_parser

COMMANDS = ("serve", "generate", "bench", "gateway", "up", "nats")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_help_line_with_its_default(command: str) -> None:
    p = _subparsers(build_parser())[command]
    missing = [a.option_strings[0] for a in p._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction)
               and "default" not in (a.help or "").lower()]
    assert not missing, f"tandem {command}: flags without a help line naming the default: {missing}"


def test_every_serve_flag_reaches_the_settings() -> None:
    """A `tandem serve` flag the settings never see would be parsed and silently ignored."""
    from dataclasses import fields

    from runtime.settings import Settings
    from tandem.cli import _SERVE_FIELDS

    p = _subparsers(build_parser())["serve"]
    dests = {a.dest for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)}
    assert dests <= set(_SERVE_FIELDS), f"serve flags not passed to Settings: {sorted(dests - set(_SERVE_FIELDS))}"
    assert set(_SERVE_FIELDS) <= {f.name for f in fields(Settings)}
