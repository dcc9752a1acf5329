"""Command-line options made from the config models: name, type, default and help come from the fields.

`config_command` turns a function ``f(..., flags: dict)`` into a typer command whose options are the settings
of a config model that the step uses (`infra.config.step_settings`, UploadConfig's fields), ``--config FILE``
included; the values a user set arrive in ``flags``, flat as the flags are named (unset ones are left out, so
they never override the file). Errors leave the
command through `cli_errors`, the one place that prints them and picks the exit code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import reprlib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import typer
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from typer.core import TyperGroup

from infra import outdir
from infra.config import SECTIONS, URL_CREDENTIALS, BuildConfig, UploadConfig
from infra.errors import EXIT_FAILED, ConfigError, LatentforgeError, exit_code
from infra.urls import redacted

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


def out_root(value: str) -> outdir.Out:
    """OUT as a command's argument names it: a local folder, or a folder URL in an object store
    (``s3://BUCKET/PREFIX``: a `StoreOut`; a `Path` would fold its ``//``)."""
    try:
        return outdir.root(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc


#: OUT, a command's argument (typer takes no union type: `Any`, and the parser `out_root` says what it is).
OutArg = Annotated[Any, typer.Argument(parser=out_root, help="cache root")]


def debugging() -> bool:
    """True under ``--debug`` or ``LATENTFORGE_DEBUG=1``: tracebacks are shown."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class ConsoleFormatter(logging.Formatter):
    """The terminal's log lines. A finding that ends the run (a `LatentforgeError` a flow raised: a loss, a failed
    gate, a remote mismatch) is logged by Prefect with its traceback; on the terminal its message is enough, since
    the command ends with it as one ``error: ...`` line. Its traceback is shown with --debug (or
    ``LATENTFORGE_DEBUG=1``); a bug's traceback always is. Only this handler's text changes: the run's logs on a
    server (Prefect's API handler) keep the traceback. Every URL in a line is shown without its credentials
    (`infra.urls.redacted`)."""

    def format(self, record: logging.LogRecord) -> str:
        return redacted(self._format(record))

    def _format(self, record: logging.LogRecord) -> str:
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
    """Print ``error: message`` to stderr and exit with `code`: every URL in it without its credentials, whatever
    their shape (`infra.urls.redacted`: the one function every printed URL goes through)."""
    typer.echo(f"error: {redacted(message)}", err=True)
    raise typer.Exit(code)


def describe(exc: BaseException) -> str:
    """The error line of any error a command ends with (one line per problem), then its detail, if it has one."""
    if isinstance(exc, ValidationError):
        problems = "; ".join(_problem(error) for error in exc.errors())
        return f"invalid configuration: {problems}"
    detail = getattr(exc, "detail", "") if isinstance(exc, LatentforgeError) else ""
    return f"{exc}\n{detail.rstrip()}" if detail else str(exc)


#: The value a problem names, bounded: a config can hold a 1 GB string or a YAML alias bomb.
_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 80, 80, 2, 4, 4
#: The pydantic errors of a bound (`infra.bounds`, the models' Field bounds).
_BOUND_ERRORS = ("less_than_equal", "less_than")
#: The settings a flag of its own sets (not the nested sections upload and alerts; `upload`'s own options).
_FLAGGED = (set(BuildConfig.settings()) - set(SECTION_FLAGS) - {"alerts"}) | set(UploadConfig.model_fields)


def _problem(error: Mapping[str, Any]) -> str:
    """One problem as the user wrote it: the setting, its flag, the value given and what is wrong
    (``frames = 1000000001 (--frames): Input should be less than or equal to 10000 (a sanity bound ...)``)."""
    where, flag = _where(error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] in _BOUND_ERRORS:
        message += " (a sanity bound, far above real data: it keeps allocations sane)"
    value = error.get("input")
    hidden = error["type"] in ("missing", URL_CREDENTIALS)  # a URL with a password in it is not echoed
    if hidden or where in ("config", *SECTIONS) or isinstance(value, Mapping | BaseModel):
        text = message if where in SECTIONS else f"{where}: {message}"  # a whole section's check names its settings
    else:
        text = f"{where} = {_SHOWN.repr(value)}{f' ({flag})' if flag else ''}: {message}"
    return " ".join(text.splitlines())


def _where(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """A problem's key as the user wrote it, a section's setting by its flat name (``frames``, not
    ``encoding.frames``; a list's item as ``only[1]``), and the flag that sets it (None: a nested key)."""
    parts = list(loc)
    if len(parts) > 1 and parts[0] in SECTIONS:
        parts = parts[1:]
    names = [str(p) for p in parts if not isinstance(p, int)]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or "config"
    return where, _flag(names[0]) if len(names) == 1 and names[0] in _FLAGGED else None


#: The usage error typer's parser raises. Since typer 0.2x carries its own copy of click, that is not
#: `click.UsageError`, and typer names it nowhere public: it is the base of `typer.BadParameter`, which is public.
_UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


class UsageLine(_UsageError):  # type: ignore[misc, valid-type]
    """A usage error the parser finds (an unknown option, a value that is not a number, a missing argument), shown as
    every other error of the command line is: one ``error: ...`` line, exit 2."""

    def show(self, file: typing.IO[Any] | None = None) -> None:
        typer.echo(f"error: {' '.join(self.format_message().splitlines())}", file=file, err=file is None)


@contextlib.contextmanager
def _one_line() -> Iterator[None]:
    try:
        yield
    except _UsageError as exc:
        if isinstance(exc, UsageLine) or type(exc).__name__ == "NoArgsIsHelpError":  # typer tells it so too
            raise  # the help a bare command shows stays the help
        raise UsageLine(exc.format_message(), exc.ctx) from exc


class OneLineGroup(TyperGroup):
    """The command line's group: the parser's usage errors, its own and its commands' (a nested group's too: they
    run inside its `invoke`), become `UsageLine`s."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _one_line():
            return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        with _one_line():
            return super().invoke(ctx)


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
