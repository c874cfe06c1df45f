"""Command-line flags generated from :class:`~loader_service.config.ServiceConfig`'s fields.

A field ``task_deadline_s`` becomes ``--task-deadline SECONDS`` (a trailing ``_s`` means
seconds), a bool ``--demo/--no-demo``, the tuple ``data`` a repeatable ``--data``; the help text
is the field's description with its default and environment variable. Every flag defaults to
None, so an absent flag leaves the config file's and the environment's value in place. Values are
passed to ``load_config`` as strings, so a bad one is reported like a bad environment variable.
"""

from __future__ import annotations

import argparse
import json
import typing
from typing import Any, Dict, Tuple

from loader_service.config import ENV_PREFIX, CONFIG_ENV, Loaded, load_config, option_extra, option_fields, redacted


def flag_name(name: str) -> str:
    return option_extra(name)["flag"] or "--" + (name[:-2] if name.endswith("_s") else name).replace("_", "-")


def add_config_options(p: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per option that may appear on a command line."""
    p.add_argument("--config", metavar="FILE", help=f"a TOML, JSON or YAML file of options (env {CONFIG_ENV}); "
                                                    "the environment and flags override it")
    group = p.add_argument_group("service options (each also LOADER_<NAME>, or <name> in --config)")
    for name, info in option_fields().items():
        extra = option_extra(name)
        if not extra["cli"]:
            continue
        default = info.default
        env = f"{ENV_PREFIX}{name.upper()}"
        shown = "" if default in ("", ()) else f"default {json.dumps(default)}; "
        help_text = f"{info.description or name} ({shown}env {env})".replace("%", "%%")
        kw: Dict[str, Any] = dict(dest=name, default=None, help=help_text)
        ann = info.annotation
        if ann is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(ann) in (tuple, Tuple):
            kw.update(action="append", metavar=extra["metavar"] or "VALUE")
        else:
            if extra["choices"]:
                kw["choices"] = extra["choices"]  # argparse shows them as the metavar
            else:
                kw["metavar"] = extra["metavar"] or ("SECONDS" if name.endswith("_s") else
                                                     "N" if ann in (int, float) else "TEXT")
        group.add_argument(flag_name(name), **kw)


def config_from_args(args: argparse.Namespace, **fixed: Any) -> Loaded:
    """The effective configuration: defaults < ``--config`` file < environment < flags < ``fixed``
    (what a subcommand decides, like ``demo``'s own dataset)."""
    overrides, origin = {}, {}
    for name in option_fields():
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = tuple(value) if isinstance(value, list) else value
            origin[name] = f"flag {flag_name(name)}"
    for name, value in fixed.items():
        if value is not None:
            overrides[name] = value
            origin[name] = f"'loader-service {args.command}'"
    return load_config(config_file=getattr(args, "config", None), overrides=overrides, override_origin=origin)


def format_config(loaded: Loaded) -> str:
    """The effective configuration as a TOML file (usable as ``--config``), secrets redacted,
    each line saying where its value came from."""
    lines = ["# loader-service: effective configuration (secrets redacted)"]
    for name, value in redacted(loaded.config).items():
        text = json.dumps(list(value) if isinstance(value, tuple) else value)
        lines.append(f"{name} = {text}".ljust(44) + f"  # {loaded.origin[name]}")
    return "\n".join(lines)
