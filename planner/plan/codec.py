"""JSON for frozen dataclasses, generated from their type hints: one encoder, one decoder, one JSON Schema.

A dataclass is a JSON object of its fields (:func:`dataclasses.fields`, typed by :func:`typing.get_type_hints`),
written in field order; reading it back, a field with a default may be left out and an unknown key is an error.
The types a field may have, and what each is in JSON:

* ``bool``, ``int``, ``float`` (an integer is read as a float; ``inf`` and ``nan`` as Python's :mod:`json` writes
  them), ``str``: themselves; ``None``: ``null``;
* ``X | None``: ``X`` or ``null``; ``Literal[...]``: one of its values; an :class:`enum.Enum`: its value;
* ``tuple[X, ...]``, ``tuple[X, Y]``, ``list[X]``: an array; ``Mapping[str, X]``, ``dict[str, X]``: an object;
* ``Any``: any JSON value, as it is; a nested dataclass: its object;
* any other class given an :class:`External` (its own writer, reader and schema: the cluster file of a plan).

:meth:`Codec.schema` is the JSON Schema (draft 2020-12) of what :meth:`Codec.encode` writes: each dataclass one
entry of ``$defs``, described by the first paragraph of its docstring, its defaults written out.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_PRIMITIVES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


class CodecError(ValueError):
    """JSON that does not have the shape of its type: the message names where (``stages[0].zero``) and why."""


@dataclass(frozen=True, kw_only=True)
class External:
    """A class the codec does not introspect: how to write it, read it back, and its schema."""

    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    schema: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class FieldType:
    """One init field of a dataclass: its name, resolved type hint, and default when it has one."""

    name: str
    hint: Any
    required: bool  # no default: the key must be there
    default: Any = None


@functools.cache
def field_types(cls: type) -> tuple[FieldType, ...]:
    """The init fields of dataclass ``cls`` with their resolved type hints."""
    hints = typing.get_type_hints(cls)
    found = []
    for entry in dataclasses.fields(cls):
        if not entry.init:
            continue
        if entry.default is not dataclasses.MISSING:
            found.append(FieldType(name=entry.name, hint=hints[entry.name], required=False, default=entry.default))
        elif entry.default_factory is not dataclasses.MISSING:
            default = entry.default_factory()
            found.append(FieldType(name=entry.name, hint=hints[entry.name], required=False, default=default))
        else:
            found.append(FieldType(name=entry.name, hint=hints[entry.name], required=True))
    return tuple(found)


class JsonCoded:
    """``to_json`` and ``from_json`` for a dataclass that holds no external class, by the default :class:`Codec`."""

    def to_json(self) -> dict[str, Any]:
        return Codec().encode(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return Codec().decode(cls, data)


def _optional_arm(hint: Any) -> Any | None:
    """``X`` of ``X | None``; None for any other hint."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
    if len(arms) != 1:
        raise TypeError(f"the codec reads X | None unions only, not {hint}")
    return arms[0]


def _is_mapping(origin: Any) -> bool:
    return origin in (dict, Mapping)


@dataclass(frozen=True, kw_only=True)
class Codec:
    """Writes dataclasses as JSON data, reads them back and gives their JSON Schema (``external``: the classes that
    bring their own format)."""

    external: Mapping[type, External] = field(default_factory=dict)

    def encode(self, value: Any) -> Any:
        """``value`` as JSON data (dicts, lists, numbers, strings, None)."""
        if type(value) in self.external:
            return self.external[type(value)].encode(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {entry.name: self.encode(getattr(value, entry.name)) for entry in field_types(type(value))}
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (tuple, list)):
            return [self.encode(item) for item in value]
        if isinstance(value, Mapping):
            return {str(key): self.encode(item) for key, item in value.items()}
        return value

    def decode(self, hint: Any, data: Any, *, where: str = "") -> Any:
        """``data`` read as a value of type ``hint``; :class:`CodecError` naming ``where`` when it is not one."""
        if hint is Any:
            return data
        if hint in self.external:
            return self.external[hint].decode(_expect(data, dict, where))
        if dataclasses.is_dataclass(hint):
            return self._decode_dataclass(hint, data, where=where)
        arm = _optional_arm(hint)
        if arm is not None:
            return None if data is None else self.decode(arm, data, where=where)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Literal:
            if not any(data == value and type(data) is type(value) for value in args):
                raise CodecError(f"{where or 'value'}: {data!r} is not one of {', '.join(map(repr, args))}")
            return data
        if origin in (tuple, list):
            return self._decode_sequence(hint, data, where=where)
        if _is_mapping(origin):
            entries = _expect(data, dict, where)
            return {key: self.decode(args[1], item, where=f"{where}.{key}") for key, item in entries.items()}
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            try:
                return hint(data)
            except ValueError:
                values = ", ".join(repr(member.value) for member in hint)
                raise CodecError(f"{where or 'value'}: {data!r} is not one of {values}") from None
        if hint is float:
            return float(_expect(data, (int, float), where))
        if hint in _PRIMITIVES:
            return _expect(data, hint, where)
        if hint is type(None):
            return _expect(data, type(None), where)
        raise TypeError(f"the codec has no JSON form for {hint!r}")

    def _decode_dataclass(self, cls: type, data: Any, *, where: str) -> Any:
        entries = _expect(data, dict, where)
        known = field_types(cls)
        unknown = sorted(set(entries) - {entry.name for entry in known})
        if unknown:
            raise CodecError(f"{where or cls.__name__}: unknown field {unknown[0]!r} of {cls.__name__}")
        values = {}
        for entry in known:
            inner = f"{where}.{entry.name}" if where else entry.name
            if entry.name in entries:
                values[entry.name] = self.decode(entry.hint, entries[entry.name], where=inner)
            elif entry.required:
                raise CodecError(f"{inner}: missing (a {cls.__name__} needs it)")
        return cls(**values)

    def _decode_sequence(self, hint: Any, data: Any, *, where: str) -> Any:
        items, args = _expect(data, list, where), typing.get_args(hint)
        if typing.get_origin(hint) is list:
            return [self.decode(args[0], item, where=f"{where}[{i}]") for i, item in enumerate(items)]
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(self.decode(args[0], item, where=f"{where}[{i}]") for i, item in enumerate(items))
        if len(items) != len(args):
            raise CodecError(f"{where or 'value'}: {len(items)} items where {len(args)} belong")
        return tuple(
            self.decode(arm, item, where=f"{where}[{i}]") for i, (arm, item) in enumerate(zip(args, items, strict=True))
        )

    def schema(self, root: type, *, title: str) -> dict[str, Any]:
        """The JSON Schema of ``root`` (a dataclass) as :meth:`encode` writes it."""
        definitions: dict[str, Any] = {}
        reference = SchemaBuilder(codec=self, definitions=definitions).schema_of(root)
        return {"$schema": SCHEMA_DIALECT, "title": title, **reference, "$defs": dict(sorted(definitions.items()))}


def _expect(data: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if isinstance(data, kind) and not (isinstance(data, bool) and kind is not bool):
        return data
    names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
    raise CodecError(f"{where or 'value'}: expected {names}, got {type(data).__name__} {data!r:.60}")


def description_of(cls: type) -> str | None:
    """The first paragraph of ``cls``'s docstring, on one line (None: no docstring of its own)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(f"{cls.__name__}("):  # dataclass's generated signature
        return None
    return " ".join(doc.strip().split("\n\n")[0].split())


@dataclass(frozen=True, kw_only=True)
class SchemaBuilder:
    """Walks type hints into JSON Schema, each dataclass and external class once into ``definitions``."""

    codec: Codec
    definitions: dict[str, Any]

    def schema_of(self, hint: Any) -> dict[str, Any]:
        if hint is Any:
            return {}
        if hint in self.codec.external:
            return self._defined(hint, lambda: dict(self.codec.external[hint].schema))
        if dataclasses.is_dataclass(hint):
            return self._defined(hint, lambda: self._object_schema(hint))
        arm = _optional_arm(hint)
        if arm is not None:
            return {"anyOf": [self.schema_of(arm), {"type": "null"}]}
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is typing.Literal:
            return {"enum": list(args)}
        if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
            return {"type": "array", "items": self.schema_of(args[0])}
        if origin is tuple:
            items = [self.schema_of(arm) for arm in args]
            return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
        if _is_mapping(origin):
            return {"type": "object", "additionalProperties": self.schema_of(args[1])}
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return {"enum": [member.value for member in hint]}
        if hint in _PRIMITIVES:
            return {"type": _PRIMITIVES[hint]}
        if hint is type(None):
            return {"type": "null"}
        raise TypeError(f"the codec has no JSON form for {hint!r}")

    def _defined(self, cls: type, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if cls.__name__ not in self.definitions:
            self.definitions[cls.__name__] = {}  # a placeholder: a class that holds itself refers, not recurses
            self.definitions[cls.__name__] = build()
        return {"$ref": f"#/$defs/{cls.__name__}"}

    def _object_schema(self, cls: type) -> dict[str, Any]:
        properties = {}
        for entry in field_types(cls):
            schema = self.schema_of(entry.hint)
            if not entry.required:
                schema = {**schema, "default": self.codec.encode(entry.default)}
            properties[entry.name] = schema
        description = description_of(cls)
        return {
            "type": "object",
            **({"description": description} if description else {}),
            "properties": properties,
            "required": [entry.name for entry in field_types(cls) if entry.required],
            "additionalProperties": False,
        }
