"""Twenty JSON schemas (nested objects, enums, arrays, required fields), each with a valid example.

Every instance of every schema is bounded (strings have a maxLength, arrays a maxItems, numbers a
range), so a model whose free text is noise still reaches the end of the document within a few
hundred tokens. The tests run them on a random-weight model and the bench on the real tokenizer.
"""

NAME = {"type": "string", "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS = [
    ({"type": "object", "properties": {"name": NAME}, "required": ["name"]}, {"name": "ada"}),
    ({"type": "object", "properties": {"age": SMALL_INT, "name": NAME}, "required": ["age", "name"]},
     {"age": 36, "name": "ada"}),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
     {"color": "green"}),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "count": SMALL_INT},
      "required": ["ok", "count"]}, {"ok": True, "count": 3}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}},
      "required": ["tags"]}, {"tags": ["a", "b"]}),
    ({"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"]}},
      "required": ["point"]}, {"point": {"x": 1, "y": 2}}),
    ({"type": "object", "properties": {"user": {
        "type": "object",
        "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}},
        "required": ["name", "address"]}}, "required": ["user"]},
     {"user": {"name": "ada", "address": {"city": "london", "zip": "01234"}}}),
    ({"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4}, [1, 2, 3]),
    ({"type": "array", "items": {"type": "object", "properties": {"id": SMALL_INT, "kind": {"enum": ["a", "b"]}},
                                 "required": ["id", "kind"]}, "minItems": 2, "maxItems": 3},
     [{"id": 1, "kind": "a"}, {"id": 2, "kind": "b"}]),
    ({"type": "object", "properties": {"status": {"const": "done"}, "code": {"enum": [200, 404, 500]}},
      "required": ["status", "code"]}, {"status": "done", "code": 404}),
    ({"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["score"]}, {"score": 0.5}),
    ({"type": "object", "properties": {"note": {"anyOf": [NAME, {"type": "null"}]}}, "required": ["note"]},
     {"note": None}),
    ({"type": "object", "properties": {"name": NAME, "nick": NAME}, "required": ["name"],
      "additionalProperties": False}, {"name": "ada", "nick": "a"}),
    ({"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": SMALL_INT, "maxItems": 2}}}, "required": ["matrix"]},
     {"matrix": [[1, 2], [3]]}),
    ({"type": "object", "properties": {"level": {"type": "string", "enum": ["debug", "info", "warn"]},
                                       "message": {"type": "string", "maxLength": 16}},
      "required": ["level", "message"]}, {"level": "info", "message": "hello"}),
    ({"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
      "required": ["date"]}, {"date": "2026-12-01"}),
    ({"type": "object", "$defs": {"item": {"type": "object", "properties": {"sku": NAME, "qty": SMALL_INT},
                                           "required": ["sku", "qty"]}},
      "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}},
      "required": ["items"]}, {"items": [{"sku": "x1", "qty": 2}]}),
    ({"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": SMALL_INT,
                                       "reasons": {"type": "array", "items": NAME, "maxItems": 2}},
      "required": ["answer", "confidence", "reasons"]},
     {"answer": "yes", "confidence": 90, "reasons": ["a"]}),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
     {"a": {"b": {"c": False}}}),
    ({"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                       "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]},
                                                  "maxItems": 2}},
      "required": ["title", "year", "genres"]}, {"title": "up", "year": 2009, "genres": ["comedy"]}),
]
