"""``TrlParser``: transformers' ``HfArgumentParser`` with TRL's ``--config FILE.yaml`` (the file's values become the
defaults, the command line overrides them; its ``env:`` mapping is set in the environment first), as TRL 1.16's
scripts parse ``(ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig)``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Any

from transformers import HfArgumentParser

from shardtune.config.schema import ConfigError


class TrlParser(HfArgumentParser):
    """TRL's ``TrlParser``: dataclasses as arguments, and a YAML ``--config``."""

    def __init__(self, dataclass_types: Any = None, **kwargs: Any) -> None:
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, Iterable):
            dataclass_types = [dataclass_types]
        for dataclass_type in dataclass_types:
            if "config" in dataclass_type.__dataclass_fields__:
                raise ConfigError(
                    f"{dataclass_type.__name__} has a field named config: TrlParser reserves --config for the YAML "
                    "file: rename the field"
                )
        super().__init__(dataclass_types=dataclass_types, **kwargs)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple[Any, ...]:
        """The dataclasses of ``args`` (default: ``sys.argv[1:]``) over a ``--config`` file's values. Keys of the file
        that no dataclass has: returned with ``return_remaining_strings`` (as ``--key value`` strings), refused with
        ``fail_with_unknown_args``, else dropped (TRL's rule); unknown command-line flags are refused as
        HfArgumentParser refuses them."""
        import sys

        args = list(args) if args is not None else sys.argv[1:]
        config_remaining: list[str] = []
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise ConfigError("--config needs a YAML file: pass --config path/to/config.yaml")
            path = args[at + 1]
            del args[at : at + 2]
            config_remaining = self.set_defaults_with_config(**_read_config(path))
        output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            remaining = output[-1]
            if separate_remaining_strings:
                return (*output[:-1], config_remaining, remaining)
            return (*output[:-1], config_remaining + remaining)
        if fail_with_unknown_args and config_remaining:
            raise ConfigError(
                f"unknown keys in the --config file: {' '.join(config_remaining[::2])}: remove them, add them to a "
                "dataclass, or pass fail_with_unknown_args=False"
            )
        return output

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """Make ``kwargs`` the parser's defaults (subparsers too; a required argument given a value stops being
        required); the keys no argument takes, as ``--key value`` strings."""
        used = _apply_defaults(self, kwargs)
        return [item for key, value in kwargs.items() if key not in used for item in (f"--{key}", str(value))]


def _read_config(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}): pass an existing YAML file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path} is not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path} must hold a YAML mapping (key: value lines)")
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise ConfigError(f"--config {path}: env must be a mapping (NAME: value)")
    for key, value in env.items():
        os.environ[key] = str(value)
    return config


def _apply_defaults(parser: argparse.ArgumentParser, values: dict[str, Any]) -> set[str]:
    used: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                used |= _apply_defaults(subparser, values)
        elif action.dest in values:
            action.default = values[action.dest]
            action.required = False
            used.add(action.dest)
    return used
