"""The machinery of a params section: ``Section`` (a pydantic model that refuses unknown keys and tells the keys that
change results from the speed knobs), ``speed`` (a field that only changes speed) and ``ConfigError`` (a params file
that breaks the schema). The sections themselves: data_sections.py, model_sections.py; the root and its loading:
config.py."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from eaglepipe.core.errors import UserError


class ConfigError(UserError, ValueError):
    """A params file that breaks the schema; the message names the file and the key."""


def speed(default, description: str, **kw):
    """A field that only changes speed: not tracked by DVC, not part of any fingerprint."""
    return Field(default, description=description, json_schema_extra={"speed": True}, **kw)


class Section(BaseModel):
    """A params section: strict types, no unknown key, frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @classmethod
    def tracked_keys(cls) -> list[str]:
        """The keys that change results (those DVC tracks), in declaration order."""
        return [k for k, f in cls.model_fields.items() if not (f.json_schema_extra or {}).get("speed")]

    def tracked(self) -> dict:
        """The result knobs' values (what fingerprints hash)."""
        return self.model_dump(include=set(self.tracked_keys()))
