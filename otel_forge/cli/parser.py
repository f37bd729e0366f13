"""The command line's argparse: help text wrapped to the terminal (examples kept as typed), and a
usage error as the usage, one line saying what is wrong, the flag meant where one is close, and exit 2."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

USAGE_ERROR = 2
_UNRECOGNIZED = "unrecognized arguments: "


class HelpFormatter(argparse.HelpFormatter):
    """Paragraphs are wrapped; a line that starts with spaces (an example command) is kept as typed."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        blocks = re.split(r"\n(?=\s)|\n\n", text)
        return "\n".join(
            indent + block if block.startswith(" ") else super(HelpFormatter, self)._fill_text(block, width, indent)
            for block in blocks
        )


class CommandParser(argparse.ArgumentParser):
    """argparse with ``HelpFormatter``; a usage error prints the usage of the command it concerns,
    one line, and a close flag for a mistyped one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_command_line(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """``parse_args``, remembering ``argv`` (default: the process's) to name its subcommand on error."""
        self._argv = list(sys.argv[1:] if argv is None else argv)
        return self.parse_args(self._argv)

    def error(self, message: str) -> NoReturn:
        parser = self._command_parser(self._argv) if message.startswith(_UNRECOGNIZED) else self
        parser.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"{parser.prog}: error: {message}{parser.close_flag(message)}\n")

    def close_flag(self, message: str) -> str:
        """``; did you mean --experiment?`` for the first unknown flag in ``message`` close to one of ours."""
        known = [option for action in self._actions for option in action.option_strings]
        for token in message.removeprefix(_UNRECOGNIZED).split():
            if token.startswith("--") and (close := difflib.get_close_matches(token.split("=")[0], known, n=1)):
                return f"; did you mean {close[0]}?"
        return ""

    def _command_parser(self, argv: list[str]) -> CommandParser:
        """The subcommand's parser that ``argv`` names (argparse reports a subcommand's unknown flags
        from the top), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 - argparse's own type
                named = next((action.choices[word] for word in argv if word in action.choices), None)
                if isinstance(named, CommandParser):
                    return named
        return self
