"""OpenAI function tools as harmony's developer-message section (TypeScript-like declarations).

GPT-OSS was trained on tools declared the way OpenAI's harmony renderer writes them:

    # Tools

    ## functions

    namespace functions {

    // Get the weather
    type get_weather = (_: {
    // City
    location: string,
    unit?: "c" | "f", // default: c
    }) => any;

    } // namespace functions

`tests/test_harmony_reference.py` checks this module against `openai-harmony` on a table of schemas,
quirks included (a nested object's description is written twice, as the renderer does).
"""
from __future__ import annotations

import json
from typing import Any

TOOLS_CHANNEL_LINE = "Calls to these tools must go to the commentary channel: 'functions'."


def tools_section(tools: list[dict[str, Any]]) -> str:
    """`tools` are OpenAI function definitions ({"name", "description", "parameters"})."""
    decls = []
    for fn in tools:
        lines = [f"// {line}" for line in (fn.get("description") or "").split("\n")] if fn.get("description") else []
        params = fn.get("parameters")
        if not params:
            lines.append(f"type {fn['name']} = () => any;")
        else:
            lines.append(f"type {fn['name']} = (_: {_object_body(params, 0, top=True)}) => any;")
        decls.append("\n".join(lines))
    return "# Tools\n\n## functions\n\nnamespace functions {\n\n" + "\n\n".join(decls) + "\n\n} // namespace functions"


def _object_body(schema: dict, depth: int, top: bool = False) -> str:
    pad = "" if top else "    " * (depth + 1)
    child = 0 if top else depth + 1  # nested objects indent by four spaces a level
    required = set(schema.get("required") or [])
    out = ["{"]
    for name, prop in (schema.get("properties") or {}).items():
        prop = prop if isinstance(prop, dict) else {}
        desc = prop.get("description")
        opt = "" if name in required else "?"
        if "oneOf" in prop:
            if desc:
                out.append(f"{pad}// {desc}")
            alts = "".join(f"\n{pad} | {_ts(a, child)}{_trailer(a)}" for a in prop["oneOf"])
            out.append(f"{pad}{name}{opt}:{alts}\n{pad},")
            continue
        if desc:
            out.append(f"{pad}// {desc}")
        if prop.get("type") == "object" and desc:  # the renderer repeats an object's description inline
            out.append(f"{pad}{name}{opt}:     // {desc}\n{pad}{_ts(prop, child)},")
            continue
        out.append(f"{pad}{name}{opt}: {_ts(prop, child)},{_trailer(prop)}")
    out.append(pad + "}" if not top else "}")
    return "\n".join(out)


def _trailer(schema: dict) -> str:
    if isinstance(schema, dict) and "default" in schema:
        d = schema["default"]
        return f" // default: {d if isinstance(d, str) else json.dumps(d)}"
    return ""


def _ts(schema: Any, depth: int) -> str:
    """One JSON-schema type as the renderer writes it."""
    if not isinstance(schema, dict):
        return "any"
    t = schema.get("type")
    if isinstance(t, list):
        return " | ".join("null" if x == "null" else _ts({**schema, "type": x}, depth) for x in t)
    if t == "string":
        enum = schema.get("enum")
        return " | ".join(json.dumps(v) for v in enum) if enum else "string"
    if t in ("number", "integer"):
        return "number"
    if t == "boolean":
        return "boolean"
    if t == "array":
        items = schema.get("items")
        return f"{_ts(items, depth)}[]" if isinstance(items, dict) else "Array<any>"
    if t == "object":
        return _object_body(schema, depth)
    return "any"
