"""Command-line options made from the config models: name, type, default and help come from the fields.

`config_command` turns a function ``f(..., flags: dict)`` into a typer command whose options are the settings
of a config model that the step uses (`infra.config.step_settings`, UploadConfig's fields), ``--config FILE``
included; the values a user set arrive in ``flags``, flat as the flags are named (unset ones are left out, so
they never override the file). Errors leave the
command through `cli_errors`, the one place that prints them and picks the exit code.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import typer
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from infra.config import SECTIONS
from infra.errors import EXIT_FAILED, LatentforgeError, exit_code

logger = logging.getLogger("latentforge")
#: Set (to 1) by ``latentforge --debug``: errors then also print their traceback.
DEBUG_ENV = "LATENTFORGE_DEBUG"

#: Nested sections set from the command line by one flag each: flag name → (field, key inside the section).
SECTION_FLAGS: dict[str, tuple[str, str]] = {
    "upload": ("upload", "to"),
    "alert_webhook": ("alerts", "webhook"),
    "alert_block": ("alerts", "block"),
}
SECTION_HELP = {
    "upload": "publish to hf://datasets/ORG/NAME or s3://BUCKET/PREFIX after the gates",
    "alert_webhook": "POST alerts here (or LATENTFORGE_ALERT_WEBHOOK)",
    "alert_block": "Prefect notification block TYPE/NAME for alerts (or LATENTFORGE_ALERT_BLOCK)",
}


def debugging() -> bool:
    """True under ``--debug`` or ``LATENTFORGE_DEBUG=1``: tracebacks are shown."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class ConsoleFormatter(logging.Formatter):
    """The terminal's log lines. A finding that ends the run (a `LatentforgeError` a flow raised: a loss, a failed
    gate, a remote mismatch) is logged by Prefect with its traceback; on the terminal its message is enough, since
    the command ends with it as one ``error: ...`` line. Its traceback is shown with --debug (or
    ``LATENTFORGE_DEBUG=1``); a bug's traceback always is. Only this handler's text changes: the run's logs on a
    server (Prefect's API handler) keep the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, LatentforgeError) or debugging():
            return super().format(record)
        kept = record.exc_info, record.exc_text  # another handler (Prefect's API one) may have cached the text
        record.exc_info, record.exc_text = None, None
        try:
            return super().format(record)
        finally:
            record.exc_info, record.exc_text = kept


def console_logging() -> None:
    """The terminal's logging: INFO and up on stderr, through `ConsoleFormatter`; httpx's request lines hidden."""
    handler = logging.StreamHandler()
    handler.setFormatter(ConsoleFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fail(message: str, code: int = 2) -> typing.NoReturn:
    """Print ``error: message`` to stderr and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def describe(exc: BaseException) -> str:
    """The error line of any error a command ends with (one line per problem), then its detail, if it has one."""
    if isinstance(exc, ValidationError):
        problems = "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
        return f"invalid configuration: {problems}"
    detail = getattr(exc, "detail", "") if isinstance(exc, LatentforgeError) else ""
    return f"{exc}\n{detail.rstrip()}" if detail else str(exc)


def _where(loc: tuple[Any, ...]) -> str:
    """A problem's key as the user wrote it: a section's setting by its flat name (``frames``, not
    ``encoding.frames``)."""
    parts = list(map(str, loc))
    if len(parts) > 1 and parts[0] in SECTIONS:
        parts = parts[1:]
    return ".".join(parts) or "config"


def cli_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """The one place a command's errors leave it: ``error: ...`` on stderr, exit code from `exit_code`."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.ClickException):
            raise
        except (LatentforgeError, ValidationError, OSError) as exc:
            if debugging():
                logger.exception("traceback (--debug)")
            fail(describe(exc), exit_code(exc))
        except Exception as exc:  # a bug, not the user's mistake: one line too; the traceback with --debug
            if debugging():
                logger.exception("traceback (--debug)")
            hint = "" if debugging() else f" (--debug or {DEBUG_ENV}=1 shows the traceback)"
            fail(f"{type(exc).__name__}: {exc}{hint}", EXIT_FAILED)

    return wrapper


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _help(field: FieldInfo, show_default: bool = True) -> str:
    text = field.description or ""
    if show_default and field.default not in (None, PydanticUndefined) and not field.is_required():
        shown = field.default if not isinstance(field.default, list) else ",".join(map(str, field.default))
        text += f" (default: {shown})"
    return text.strip()


def field_option(name: str, field: FieldInfo, show_default: bool = True) -> inspect.Parameter:
    """A keyword parameter with a typer Option for one config field (default None: unset)."""
    kind = _unwrap_optional(field.annotation)
    if typing.get_origin(kind) is Literal:
        pass  # typer offers the choices and refuses others
    elif typing.get_origin(kind) is list:
        kind = list[str]
    elif kind not in (int, float, str, bool):
        raise TypeError(f"no command-line form for {name}: {field.annotation}")
    decls = [f"{_flag(name)}/--no-{name.replace('_', '-')}"] if kind is bool else [_flag(name)]
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    decls += [f" /{flag}" for flag in extra.get("off_flags", [])]  # more names for --no-X (--skip-audio)
    option = typer.Option(*decls, help=_help(field, show_default), show_default=False)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def model_options(fields: Mapping[str, FieldInfo], show_defaults: bool = True) -> list[inspect.Parameter]:
    """Options for the settings `fields` (flat name → field); upload and alerts get their one-flag forms
    (`SECTION_FLAGS`)."""
    params = []
    for name, field in fields.items():
        section_flags = [flag for flag, (section, _) in SECTION_FLAGS.items() if section == name]
        if section_flags:
            for flag in section_flags:
                option = typer.Option(_flag(flag), help=SECTION_HELP[flag], show_default=False)
                params.append(
                    inspect.Parameter(
                        flag, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[str | None, option]
                    )
                )
        else:
            params.append(field_option(name, field, show_defaults))
    return params


def collect_flags(values: dict[str, Any]) -> dict[str, Any]:
    """Option values → config keys: unset options dropped, one-flag sections nested."""
    flags: dict[str, Any] = {}
    for name, value in values.items():
        if value is None or value == []:
            continue
        if name in SECTION_FLAGS:
            section, key = SECTION_FLAGS[name]
            flags.setdefault(section, {})[key] = value
        else:
            flags[name] = value
    return flags


CONFIG_FILE = inspect.Parameter(
    "config_file",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[Path | None, typer.Option("--config", help="YAML file; flags override its keys")],
)


def config_command(
    fields: Mapping[str, FieldInfo], *, config_file: bool = True, show_defaults: bool = True
) -> Callable:
    """Decorate ``f(*own, flags: dict, config_file: Path | None)``: its options become its own parameters plus
    the settings `fields` (flat name → field, e.g. `infra.config.step_settings`) and ``--config``; errors leave
    through `cli_errors`. `show_defaults`: say the model's defaults in the help (not for steps on an existing OUT,
    whose defaults are its own)."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p
            for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.name not in ("flags", "config_file")
        ]
        generated = model_options(fields, show_defaults)
        taken = {p.name for p in generated}

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            flag_values = {k: kwargs.pop(k) for k in list(kwargs) if k in taken}
            extra = {"config_file": kwargs.pop("config_file", None)} if config_file else {}
            return func(**kwargs, **extra, flags=collect_flags(flag_values))

        params = [*own, *([CONFIG_FILE] if config_file else []), *generated]
        command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        )
        command.__annotations__ = {}
        return cli_errors(command)

    return wrap
