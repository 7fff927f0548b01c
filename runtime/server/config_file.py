"""vLLM's `--config FILE`: a YAML file of a command's options, keyed by their flag names (`port: 8000`,
`tensor-parallel-size: 2`, `served-model-name: [a, b]`, `speculative-config: {method: ngram, ...}`).

The file's values become the command's defaults, so that a flag on the command line wins over the file, and
the file over the built-in defaults, as in vLLM. A key that names no option of the command is refused by
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

CONFIG_SUFFIXES = (".yaml", ".yml")


def read_config_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Click's callback of the eager --config option: the file's options as the command's defaults."""
    if value is None:
        return
    import yaml  # only for a command given a file: the server's start imports no more than it needs

    path = Path(value)
    if path.suffix not in CONFIG_SUFFIXES:
        raise click.BadParameter(f"{value}: a config file is YAML ({', '.join(CONFIG_SUFFIXES)})", ctx, param)
    try:
        content = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise click.BadParameter(f"{value} cannot be read: {error}", ctx, param) from None
    if not isinstance(content, dict):
        raise click.BadParameter(f"{value} must map option names to values", ctx, param)
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option) and p.name}
    defaults = {}
    for key, setting in content.items():
        name = str(key).removeprefix("--").replace("-", "_")
        option = options.get(name)
        if option is None or option is param:
            raise click.BadParameter(f"{value}: {key!r} is not an option of this command", ctx, param)
        defaults[name] = _as_default(option, setting)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}


def _as_default(option: click.Option, setting: Any) -> Any:
    """A YAML value as the option's default: a list for a list option, and scalars as the flag's text."""
    if option.multiple:
        return tuple(str(item) for item in (setting if isinstance(setting, list) else [setting]))
    if isinstance(setting, list):
        return tuple(setting)
    if isinstance(setting, dict | bool) or setting is None:
        return setting
    return str(setting)
