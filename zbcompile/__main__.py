"""The `zbcompile` command line: `zbcompile plan ...` and `zbcompile inspect ...`.

Every error we raise on purpose (ZBCompileError) and every usage error ends the same way: one message on
stderr starting with `zbcompile: error:` (a schedule grid may follow on later lines), exit status 2, no
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from zbcompile.errors import ZBCompileError

__all__ = ["main"]

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a single line instead of the usage block plus the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"zbcompile: error: {message} (see `{self.prog} --help`)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    from zbcompile import plan, plan_cli

    parser = _Parser(prog="zbcompile", description="Zero Bubble pipeline-parallel training compiler.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan_parser = commands.add_parser("plan", help="generate or load a schedule, simulate it, draw it",
                                      description=(plan.__doc__ or "").split("\n\n")[0])   # None under python -OO
    plan_cli.add_arguments(plan_parser)
    plan_parser.set_defaults(run=plan_cli.run)
    inspect_parser = commands.add_parser("inspect", help="show what the compiler did to a model",
                                         add_help=False)
    # inspect pulls in torch and the tracing passes; load it only when asked for, so `plan` stays light
    # and keeps working whatever state inspect is in.
    if "inspect" in argv[:1]:
        try:
            inspect_command = importlib.import_module("zbcompile.inspect")
        except ModuleNotFoundError as exc:
            if exc.name != "zbcompile.inspect":
                raise
            raise ZBCompileError("the inspect command is not installed in this build") from None

        inspect_parser.add_argument("-h", "--help", action="help", help="show this help message and exit")
        inspect_command.add_arguments(inspect_parser)
        inspect_parser.set_defaults(run=inspect_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
        return int(args.run(args) or 0)
    except ZBCompileError as exc:
        print(f"zbcompile: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # argparse's --help and usage errors: return the status instead of exiting
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    except BrokenPipeError:  # `zbcompile plan ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
