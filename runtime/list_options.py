"""vLLM's list-valued flags on click commands: `--lora-modules a=P b=P`, `--served-model-name a b` (argparse's
nargs="+"), beside click's repeated form (`--lora-modules a=P --lora-modules b=P`).

A list flag takes every argument after it up to the next one that begins with `-`, as argparse does; so a
positional argument goes before it, as in vLLM's documented `vllm serve MODEL --served-model-name a b`.
"""

from __future__ import annotations

from typing import Any

import click


class ListOption(click.Option):
    """A repeatable option that also takes several values after one flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, multiple=True, **kwargs)


class ListOptionsCommand(click.Command):
    """A command whose ListOptions take vLLM's list form."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        flags = {flag for param in self.params if isinstance(param, ListOption) for flag in param.opts}
        return super().parse_args(ctx, repeated_form(args, frozenset(flags)))


def repeated_form(args: list[str], flags: frozenset[str]) -> list[str]:
    """`args` with each list flag's further values written as click's repeated flags."""
    rewritten: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        index += 1
        rewritten.append(arg)
        if arg == "--":
            return rewritten + args[index:]
        flag, has_value, _ = arg.partition("=")
        if flag not in flags:
            continue
        if not has_value and index < len(args):
            rewritten.append(args[index])  # the flag's first value, as click would take it
            index += 1
        while index < len(args) and not args[index].startswith("-"):
            rewritten += [flag, args[index]]
            index += 1
    return rewritten
