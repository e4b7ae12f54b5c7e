"""One settings object per service (ADR-0014): a pydantic-settings model whose fields are
every knob of the process. Each field is declared once with its default, its help text and
its flag; the CLI is generated from the fields, and every field also reads
``MESHNET_<FLAG>`` from the environment (flags win over env, env over the default).

Only the flags given on the command line reach the model (argparse defaults are
suppressed), so pydantic-settings does the env lookup and the validation in one place,
and ``--help`` shows each default and env name from the field itself."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import AliasChoices, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "MESHNET_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def knob(
    default: Any,
    help: str,
    *,
    group: str,
    flag: str | None = None,
    choices: typing.Iterable[str] | None = None,
    action: str | None = None,
    hidden: bool = False,
    secret: bool = False,
) -> Any:
    """A settings field with its CLI flag. ``flag`` defaults to ``--field-name``; the env
    name follows the flag (``--heartbeat-interval`` -> ``MESHNET_HEARTBEAT_INTERVAL``).
    ``action``: "append" (repeatable flag, comma-separated env) or "bool" (--x/--no-x)."""
    extra: dict[str, Any] = {"group": group, "help": help, "hidden": hidden}
    if choices is not None:
        extra["choices"] = list(choices)
    if action is not None:
        extra["action"] = action
    alias = None
    if flag is not None:
        extra["flag"] = flag
        alias = AliasChoices(env_name(_dest(flag)))  # the env name; init by field name
    return Field(default, validation_alias=alias, repr=not secret, json_schema_extra=extra)


def internal(default: Any, help: str) -> Any:
    """A field the process sets itself (no flag, no env): the shard it was assigned."""
    return Field(default, description=help, json_schema_extra={"internal": True})


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


class ServiceSettings(BaseSettings):
    """Base of the services' settings: frozen, unknown fields refused, env ``MESHNET_*``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        validate_by_name=True,
        validate_by_alias=True,
        arbitrary_types_allowed=True,
    )

    # Help groups in the order shown: title -> description (None: no description).
    GROUPS: ClassVar[dict[str, str | None]] = {}
    GROUP_TITLES: ClassVar[dict[str, str]] = {}  # group key -> the title shown (default: key)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_rest):
        return (init_settings, env_settings)  # no .env files or secret dirs: flags, env

    # -- the CLI -------------------------------------------------------------------------

    @classmethod
    def flag_fields(cls) -> dict[str, FieldInfo]:
        return {
            name: f
            for name, f in cls.model_fields.items()
            if not (f.json_schema_extra or {}).get("internal")
        }

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, grouped; help shows the default and the env name."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        for key, description in cls.GROUPS.items():
            title = cls.GROUP_TITLES.get(key, key)
            groups[key] = parser.add_argument_group(title, description)
        for name, info in cls.flag_fields().items():
            meta = dict(info.json_schema_extra or {})
            group = groups.get(meta["group"])
            if group is None:
                group = groups[meta["group"]] = parser.add_argument_group(meta["group"])
            flag = meta.get("flag") or "--" + name.replace("_", "-")
            dest = _dest(flag)
            kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
            action = meta.get("action")
            if action == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            elif action == "append":
                kwargs["action"] = "append"
            elif info.annotation is bool:
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = _scalar_type(info.annotation)
                if meta.get("choices"):
                    kwargs["choices"] = meta["choices"]
            if meta.get("hidden"):
                kwargs["help"] = argparse.SUPPRESS
            else:
                kwargs["help"] = _help_text(meta["help"], info.default, env_name(dest))
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace, **values: Any) -> Self:
        """The settings from the flags given (``namespace``), the env, and the defaults;
        ``values`` set fields the process decided itself. ValueError names the bad knob."""
        given = dict(values)
        for name, info in cls.flag_fields().items():
            flag = (info.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")
            if hasattr(namespace, _dest(flag)):
                given[name] = getattr(namespace, _dest(flag))
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ValueError(describe_error(cls, exc)) from None

    @classmethod
    def exactly(cls, **values: Any) -> Self:
        """Settings from ``values`` and the defaults only (the env is not read): settings a
        process derives for a part of itself, e.g. the tracker node's node settings."""
        defaults = {
            n: f.get_default(call_default_factory=True)
            for n, f in cls.model_fields.items()
            if not f.is_required()
        }
        return cls(**(defaults | values))

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes`` validated (the settings themselves are frozen)."""
        return type(self).exactly(**(self.model_dump() | changes))


def describe_error(cls: type[ServiceSettings], exc: ValidationError) -> str:
    """One line naming each bad knob by its flag and env name."""
    parts = []
    for err in exc.errors():
        loc = str(err["loc"][0]) if err["loc"] else "?"
        info = cls.model_fields.get(loc)
        if info is None:  # reported under its env alias
            name = next(
                (n for n, f in cls.model_fields.items() if _env_of(n, f) == loc.upper()), loc
            )
            info = cls.model_fields.get(name)
            loc = name
        flag = "--" + loc.replace("_", "-")
        if info is not None:
            flag = (info.json_schema_extra or {}).get("flag") or flag
        parts.append(f"{flag} [env {env_name(_dest(flag))}]: {err['msg']}")
    return "; ".join(parts)


def _env_of(name: str, info: FieldInfo) -> str:
    flag = (info.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")
    return env_name(_dest(flag))


def _scalar_type(annotation: Any) -> Any:
    """The argparse ``type`` for a field's annotation (``X | None`` -> X)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = (
        args[0]
        if args and typing.get_origin(annotation) in (typing.Union, _UnionType)
        else annotation
    )
    if base in (int, float):
        return base
    if base is Path:
        return str  # validated (and converted) by the model
    return str


_UnionType = type(int | None)


def _help_text(text: str, default: Any, env: str) -> str:
    if default not in (None, False, (), [], "") and "default:" not in text:
        shown = getattr(default, "value", default)
        text += f" (default: {shown})"
    return f"{text} [env {env}]".replace("%", "%%")
