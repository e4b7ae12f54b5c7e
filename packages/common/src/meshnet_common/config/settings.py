"""One settings object per service (ADR-0014): a pydantic-settings model whose fields are
every knob of the process. Each field is declared once with its default, its help text and
its flag; the CLI is generated from the fields, and every field also reads
``MESHNET_<FLAG>`` from the environment and, with ``--config FILE``, a key of a YAML or
TOML file (flag over env, env over file, file over the default).

Only the flags given on the command line reach the model (argparse defaults are
suppressed), so pydantic-settings does the env lookup, the file and the validation in one
place, and ``--help`` shows each default and env name from the field itself."""

from __future__ import annotations

import argparse
import difflib
import os
import typing
from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import AliasChoices, Field, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

ENV_PREFIX = "MESHNET_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"  # the --config file, when the flag is not given
CONFIG_FORMATS = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}
CONFIG_HELP = (
    "read settings from a YAML (.yaml, .yml) or TOML (.toml) file whose keys are the flags "
    "without the leading -- (e.g. port: 8000, model_id: ORG/NAME; - or _ alike); a flag wins "
    "over its env var, the env over the file, the file over the default"
)
# The --config file's values (field name -> value) while from_args builds the settings.
_file_values: ContextVar[dict[str, Any] | None] = ContextVar("meshnet_file_values", default=None)


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

    @field_validator("*", mode="after")
    @classmethod
    def _in_choices(cls, value: Any, info: ValidationInfo) -> Any:
        """A knob with ``choices`` takes only those, from the env and the file as from a flag."""
        field = cls.model_fields.get(info.field_name or "")
        choices = ((field and field.json_schema_extra) or {}).get("choices")
        if choices and value is not None and str(value) not in map(str, choices):
            raise ValueError(f"expected one of {', '.join(map(str, choices))} (not {value!r})")
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_rest):
        # flags, env, then the --config file (read by read_config_file); no .env or secrets
        values = _file_values.get()
        if values is None:
            return (init_settings, env_settings)
        return (init_settings, env_settings, InitSettingsSource(settings_cls, values))

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
        """``--config`` and one flag per field, grouped; help shows the default and the env."""
        parser.add_argument(
            "--config", dest="config", metavar="FILE", default=argparse.SUPPRESS,
            help=_help_text(CONFIG_HELP, None, CONFIG_ENV),
        )  # fmt: skip
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
        """The settings from the flags given (``namespace``), the env, the ``--config`` file
        (or ``MESHNET_CONFIG``) and the defaults; ``values`` set fields the process decided
        itself. ValueError names the bad knob (and the file and key, for a file's value)."""
        given = dict(values)
        for name, info in cls.flag_fields().items():
            if hasattr(namespace, _dest(_flag_of(name, info))):
                given[name] = getattr(namespace, _dest(_flag_of(name, info)))
        path = getattr(namespace, "config", None) or os.environ.get(CONFIG_ENV) or None
        keys = read_config_file(cls, path) if path else {}
        file_values = {name: value for name, (_key, value) in keys.items()}
        token = _file_values.set(file_values if path else None)
        try:
            return cls(**given)
        except ValidationError as exc:
            env = {n.upper() for n in os.environ}
            from_file = {
                name: f"--config {path}: key {key!r}"
                for name, (key, _value) in keys.items()
                if name not in given and _env_of(name, cls.model_fields[name]) not in env
            }
            raise ValueError(describe_error(cls, exc, from_file)) from None
        finally:
            _file_values.reset(token)

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


def read_config_file(cls: type[ServiceSettings], path: str | Path) -> dict[str, tuple[str, Any]]:
    """The settings in a ``--config`` file, read by pydantic-settings' YAML or TOML source:
    field name -> (the key as written, its value). A key is a flag without ``--`` (dashes
    or underscores) or a field's name. ValueError: one line naming the file (and the key)."""
    where = f"--config {path}"
    path = Path(path).expanduser()
    kind = CONFIG_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"{where}: not a .yaml, .yml or .toml file")
    if not path.is_file():
        raise ValueError(f"{where}: no such file")
    try:
        if kind == "yaml":
            raw = YamlConfigSettingsSource(cls, yaml_file=path).yaml_data
        else:
            raw = TomlConfigSettingsSource(cls, toml_file=path).toml_data
    except (OSError, UnicodeDecodeError, ImportError) as exc:
        raise ValueError(f"{where}: cannot read it: {_one_line(exc)}") from None
    except Exception as exc:  # the parser's error, or a top level that is not a mapping
        if not type(exc).__module__.startswith(("yaml", "tomllib")):
            raise ValueError(f"{where}: the file must be a mapping of key: value") from None
        raise ValueError(f"{where}: not valid {kind.upper()}: {_one_line(exc)}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: the file must be a mapping of key: value")
    names = _file_keys(cls)
    found: dict[str, tuple[str, Any]] = {}
    for key, value in raw.items():
        name = names.get(str(key).lower().replace("-", "_"))
        if name is None:
            close = difflib.get_close_matches(str(key).replace("-", "_"), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown key {key!r}{hint}; the keys are the flags without --"
            )
        if name in found:
            raise ValueError(f"{where}: keys {found[name][0]!r} and {key!r} set the same knob")
        found[name] = (str(key), value)
    return found


def _file_keys(cls: type[ServiceSettings]) -> dict[str, str]:
    """The keys a config file may use -> the field: each flag's name and each field's."""
    keys = {}
    for name, info in cls.flag_fields().items():
        keys[name] = keys[_dest(_flag_of(name, info))] = name
    return keys


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def describe_error(
    cls: type[ServiceSettings], exc: ValidationError, from_file: dict[str, str] | None = None
) -> str:
    """One line naming each bad knob by its flag and env name, or by the config file and key
    it came from (``from_file``: field name -> that prefix)."""
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
        if loc in (from_file or {}):
            parts.append(f"{from_file[loc]}: {err['msg']}")
            continue
        flag = "--" + loc.replace("_", "-")
        if info is not None:
            flag = _flag_of(loc, info)
        parts.append(f"{flag} [env {env_name(_dest(flag))}]: {err['msg']}")
    return "; ".join(parts)


def _flag_of(name: str, info: FieldInfo) -> str:
    return (info.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")


def _env_of(name: str, info: FieldInfo) -> str:
    return env_name(_dest(_flag_of(name, info)))


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
