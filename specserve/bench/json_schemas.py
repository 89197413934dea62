"""JSON schemas for structured output: nested objects, enums, arrays with bounds, numbers
with ranges, optional fields, each with a chat prompt asking for it. Written for specserve
(not taken from any benchmark); the structured-output tests and benchmarks share them.
Every number has a ``multipleOf``: without one, a grammar allows digits without end, and a
small model may write them until ``max_tokens``. Each is a power of two, so that
``jsonschema`` checks it exactly in binary floating point."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchemaTask:
    name: str
    prompt: str
    schema: dict


def _obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False,
            **extra}


_STR = {"type": "string", "maxLength": 40}

SCHEMA_TASKS: tuple[SchemaTask, ...] = (
    SchemaTask("person", "Describe a fictional person as JSON.",
               _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    SchemaTask("weather", "Give today's weather in Paris as JSON.",
               _obj({"city": _STR, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.5},
                     "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]}})),
    SchemaTask("book", "Recommend one book as JSON.",
               _obj({"title": _STR, "author": _STR, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
                     "genres": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}})),
    SchemaTask("todo", "Make a short to-do list as JSON.",
               _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": _obj({"task": _STR, "done": {"type": "boolean"}})}})),
    SchemaTask("address", "Write a postal address as JSON.",
               _obj({"street": _STR, "city": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                     "country": {"enum": ["FR", "DE", "US", "JP"]}})),
    SchemaTask("rating", "Rate a restaurant as JSON.",
               _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _STR})),
    SchemaTask("point", "Give a point on a map as JSON.",
               _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0625},
                     "lon": {"type": "number", "minimum": -180, "maximum": 180,
                             "multipleOf": 0.0625}})),
    SchemaTask("color", "Pick a color as JSON.",
               _obj({"name": _STR, "rgb": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255},
                                           "minItems": 3, "maxItems": 3}})),
    SchemaTask("order", "Write a pizza order as JSON.",
               _obj({"size": {"enum": ["small", "medium", "large"]},
                     "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "olives", "mushrooms"]},
                                  "maxItems": 3},
                     "quantity": {"type": "integer", "minimum": 1, "maximum": 9}})),
    SchemaTask("event", "Describe a meeting as JSON.",
               _obj({"title": _STR, "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                     "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                     "attendees": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 2}})),
    SchemaTask("company", "Describe a company and its CEO as JSON.",
               _obj({"name": _STR, "ceo": _obj({"name": _STR, "since": {"type": "integer", "minimum": 1900,
                                                                         "maximum": 2030}}),
                     "public": {"type": "boolean"}})),
    SchemaTask("product", "Describe a product for an online shop as JSON.",
               _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                     "price": {"type": "number", "minimum": 0, "maximum": 10000, "multipleOf": 0.25},
                     "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": _STR, "maxItems": 2}},
                    required=["sku", "price", "in_stock"])),
    SchemaTask("sentiment", "Classify the sentiment of 'I love this phone' as JSON.",
               _obj({"label": {"enum": ["positive", "negative", "neutral"]},
                     "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}})),
    SchemaTask("translation", "Translate 'good morning' into French as JSON.",
               _obj({"source": _STR, "target": _STR, "language": {"enum": ["fr", "es", "de"]}})),
    SchemaTask("recipe", "Give a simple recipe as JSON.",
               _obj({"name": _STR, "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
                     "steps": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}})),
    SchemaTask("flight", "Describe a flight as JSON.",
               _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                     "seats": {"type": "integer", "minimum": 1, "maximum": 6},
                     "class": {"enum": ["economy", "business", "first"]}})),
    SchemaTask("matrix", "Give a 2 by 2 matrix of small integers as JSON.",
               _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                        "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    SchemaTask("user_profile", "Create a user profile with settings as JSON.",
               _obj({"username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                     "settings": _obj({"theme": {"enum": ["light", "dark"]}, "notifications": {"type": "boolean"}}),
                     "nickname": _STR},
                    required=["username", "settings"])),
    SchemaTask("tool_args", "Call a function to search the web for 'speculative decoding' as JSON.",
               _obj({"query": _STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                     "safe": {"type": "boolean"}})),
    SchemaTask("invoice", "Write a small invoice as JSON.",
               _obj({"number": {"type": "integer", "minimum": 1, "maximum": 99999},
                     "lines": {"type": "array", "minItems": 1, "maxItems": 2,
                               "items": _obj({"item": _STR, "qty": {"type": "integer", "minimum": 1, "maximum": 50},
                                              "unit_price": {"type": "number", "minimum": 0, "maximum": 1000,
                                                             "multipleOf": 0.25}})},
                     "currency": {"enum": ["EUR", "USD"]}})),
    SchemaTask("yes_no", "Is water wet? Answer as JSON.",
               _obj({"answer": {"type": "boolean"}, "reason": _STR})),
    SchemaTask("planet", "Describe a planet of the solar system as JSON.",
               _obj({"name": {"enum": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]},
                     "moons": {"type": "integer", "minimum": 0, "maximum": 200},
                     "rings": {"type": "boolean"}})),
)
