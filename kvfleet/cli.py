"""The `kvfleet` command.

Subcommands are imported only when invoked, so `kvfleet operator` never pulls in torch
and `--help` is instant.
"""

from __future__ import annotations

import importlib
import logging

import click

# name -> "module:attribute" of a click command or group.
COMMANDS: dict[str, str] = {
    "make-model": "kvfleet.runtime.cli:make_model",
    "make-adapter": "kvfleet.runtime.cli:make_adapter",
    "download-model": "kvfleet.runtime.cli:download_model",
    "build-kernels": "kvfleet.runtime.cli:build_kernels",
    "generate": "kvfleet.runtime.cli:generate",
    "demo": "kvfleet.runtime.cli:demo",
    "bench": "kvfleet.runtime.bench.cli:bench",
    "operator": "kvfleet.operator.cli:operator_command",
    "gateway": "kvfleet.gateway.cli:gateway_command",
    "serve": "kvfleet.runtime.server.cli:serve",
    "run-batch": "kvfleet.runtime.batch.cli:run_batch",
    "simulate": "kvfleet.simulate.cli:simulate",
}


LOG_LEVELS = ("debug", "info", "warning", "error")


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attribute = target.split(":")
        return _with_log_level(getattr(importlib.import_module(module_name), attribute))


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        logging.getLogger().setLevel(value.upper())


def _with_log_level(command: click.Command) -> click.Command:
    """The command, and each of a group's, also taking --log-level after its name (as vLLM's commands do);
    given there, it overrides the one before the subcommand."""
    if not any(param.name == "log_level" for param in command.params):
        command.params.append(
            click.Option(
                ["--log-level"],
                type=click.Choice(LOG_LEVELS),
                default=None,
                expose_value=False,
                is_eager=True,
                callback=_set_log_level,
                help="Log level; the same as `kvfleet --log-level`.",
            )
        )
    if isinstance(command, click.Group):
        for subcommand in command.commands.values():
            _with_log_level(subcommand)
    return command


@click.group(cls=LazyGroup)
@click.version_option(package_name="kvfleet")
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    default="info",
    show_default=True,
    envvar="KVFLEET_LOG_LEVEL",
)
def cli(log_level: str) -> None:
    """kvfleet: LLM inference runtime and Kubernetes operator."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main() -> None:
    cli(prog_name="kvfleet")
