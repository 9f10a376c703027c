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
