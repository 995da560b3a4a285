"""The plan's JSON Schema, generated from the plan's types by the codec that writes plans.

``python -m planner.plan.schema > docs/plan-schema.json`` writes the published copy; ``tests/test_plan_schema.py``
checks that copy is up to date and that plans made by every method validate against it. The derived ``megatron``
block (:mod:`planner.plan.megatron_terms`) is an optional, ``readOnly`` property: written with every plan, never
read back.
"""

from __future__ import annotations

import json
from typing import Any

from planner.plan.codec import SchemaBuilder
from planner.plan.megatron_terms import MegatronTerms
from planner.plan.value import DERIVED_KEY, FORMAT_VERSION, PLAN_CODEC, Plan

TITLE = "autoplan plan"


def plan_schema() -> dict[str, Any]:
    """The JSON Schema of a plan file of this :data:`FORMAT_VERSION` (draft 2020-12)."""
    schema = PLAN_CODEC.schema(Plan, title=TITLE)
    plan = schema["$defs"]["Plan"]
    plan["properties"]["format_version"] = {"const": FORMAT_VERSION}
    plan["required"] = [*plan["required"], "format_version"]
    definitions = dict(schema["$defs"])
    derived = SchemaBuilder(codec=PLAN_CODEC, definitions=definitions).schema_of(MegatronTerms)
    plan["properties"][DERIVED_KEY] = {
        **derived,
        "readOnly": True,
        "description": "derived from the plan on every write and ignored on read (recomputed)",
    }
    return {**schema, "$defs": dict(sorted(definitions.items()))}


def schema_text() -> str:
    """The schema as ``docs/plan-schema.json`` holds it."""
    return json.dumps(plan_schema(), indent=2) + "\n"


if __name__ == "__main__":
    print(schema_text(), end="")
