"""The generic dataclass ⇄ JSON codec the plan is written by: every type it knows, its errors, and its schema."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import jsonschema
import pytest

from planner.plan.codec import Codec, CodecError, External, JsonCoded


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, kw_only=True)
class Inner(JsonCoded):
    """A nested value."""

    name: str
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Outer(JsonCoded):
    """Every kind of field the codec knows."""

    count: int
    ratio: float
    flag: bool
    inners: tuple[Inner, ...]
    pair: tuple[int, str]
    specs: tuple[tuple[str, ...] | None, ...]
    names: list[str]
    table: Mapping[str, float]
    maybe: Inner | None
    colour: Colour
    kind: Literal["a", "b"]
    anything: Mapping[str, Any] = field(default_factory=dict)
    note: str | None = None


def an_outer() -> Outer:
    return Outer(
        count=3,
        ratio=math.inf,
        flag=True,
        inners=(Inner(name="x"), Inner(name="y", weight=0.5)),
        pair=(1, "one"),
        specs=(("S(0)", "R"), None),
        names=["p", "q"],
        table={"compute_s": 0.25, "comm_s": 0.0},
        maybe=None,
        colour=Colour.BLUE,
        kind="b",
        anything={"layers": 2, "attention": "unfused", "nested": [1, {"a": None}]},
    )


def test_every_type_round_trips_through_json_text() -> None:
    value = an_outer()
    data = value.to_json()
    assert data["colour"] == "blue" and data["pair"] == [1, "one"] and data["specs"] == [["S(0)", "R"], None]
    assert list(data) == [entry.name for entry in fields(Outer)]  # field order
    again = Outer.from_json(json.loads(json.dumps(data)))
    assert again == value and again.colour is Colour.BLUE and isinstance(again.inners, tuple)


def test_a_field_with_a_default_may_be_left_out_and_an_int_reads_as_a_float() -> None:
    data = {**an_outer().to_json(), "ratio": 2}
    del data["note"], data["anything"]
    data["inners"] = [{"name": "z"}]
    value = Outer.from_json(data)
    assert value.ratio == 2.0 and isinstance(value.ratio, float) and value.inners == (Inner(name="z", weight=1.0),)
    assert value.note is None and value.anything == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("count"), r"^count: missing \(a Outer needs it\)"),
        (lambda d: d.update(extra=1), r"unknown field 'extra' of Outer"),
        (lambda d: d.update(count="3"), r"^count: expected int, got str"),
        (lambda d: d.update(count=True), r"^count: expected int, got bool"),
        (lambda d: d.update(flag=1), r"^flag: expected bool, got int"),
        (lambda d: d.update(colour="green"), r"^colour: 'green' is not one of 'red', 'blue'"),
        (lambda d: d.update(kind="c"), r"^kind: 'c' is not one of 'a', 'b'"),
        (lambda d: d.update(pair=[1]), r"^pair: 1 items where 2 belong"),
        (lambda d: d["inners"][1].update(weight="heavy"), r"^inners\[1\]\.weight: expected int or float"),
        (lambda d: d["table"].update(comm_s=None), r"^table\.comm_s: expected int or float, got NoneType"),
        (lambda d: d.update(specs=[["R"], 3]), r"^specs\[1\]: expected list, got int"),
    ],
)
def test_each_malformed_value_is_named_by_its_path(change, message: str) -> None:
    data = json.loads(json.dumps(an_outer().to_json()))
    change(data)
    with pytest.raises(CodecError, match=message):
        Outer.from_json(data)


def test_the_schema_describes_what_the_encoder_writes() -> None:
    schema = Codec().schema(Outer, title="outer")
    definition = schema["$defs"]["Outer"]
    assert schema["$ref"] == "#/$defs/Outer" and definition["description"] == "Every kind of field the codec knows."
    assert definition["required"] == [entry.name for entry in fields(Outer)][:-2]  # all but the defaulted two
    assert definition["properties"]["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert definition["properties"]["colour"] == {"enum": ["red", "blue"]}
    assert schema["$defs"]["Inner"]["properties"]["weight"] == {"type": "number", "default": 1.0}
    data = an_outer().to_json()
    data["ratio"] = 1.5  # JSON Schema numbers are finite; the codec writes inf as Python's json does
    jsonschema.validate(data, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "kind": "c"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "extra": 1}, schema)


@dataclass(frozen=True, kw_only=True)
class Point:
    x: int

    def as_text(self) -> str:
        return f"({self.x})"


@dataclass(frozen=True, kw_only=True)
class HoldsPoint:
    point: Point


def test_an_external_class_is_written_and_read_by_its_own_functions() -> None:
    codec = Codec(
        external={
            Point: External(
                encode=lambda p: {"text": p.as_text()},
                decode=lambda d: Point(x=int(d["text"].strip("()"))),
                schema={"type": "object", "properties": {"text": {"type": "string"}}},
            )
        }
    )
    value = HoldsPoint(point=Point(x=4))
    assert codec.encode(value) == {"point": {"text": "(4)"}}
    assert codec.decode(HoldsPoint, {"point": {"text": "(4)"}}) == value
    assert codec.schema(HoldsPoint, title="t")["$defs"]["Point"]["properties"] == {"text": {"type": "string"}}
