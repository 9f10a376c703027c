"""JSON schemas the structured-output tests constrain the real model with."""

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "country": {"enum": ["France", "Germany", "Italy", "Spain"]},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    "capital": {"type": "boolean"}}, "required": ["city", "country", "landmarks", "capital"],
    "additionalProperties": False}
