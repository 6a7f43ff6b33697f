"""Which OpenAI / vLLM request fields the server honours and which it refuses: no silent drops.

Every field a request model declares carries its support in `json_schema_extra`: `honoured` (it changes
the answer as OpenAI / vLLM document), or `refused` (a 400 naming it, unless it holds one of its neutral
values, which ask for what the server does anyway). A field no model declares is refused by name as
well (`extra="forbid"`). docs/cluster.md's field table is `field_table()`'s text, and a test checks it.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


def honoured(note: str, **field_kw: Any) -> Any:
    """A field the server implements; `note` says how (it goes into the docs' table)."""
    field_kw.setdefault("default", None)
    return Field(json_schema_extra={"support": "honoured", "note": note}, **field_kw)


def refused(*neutral: Any, note: str) -> Any:
    """A field refused with a 400 unless its value is None or one of `neutral`."""
    return Field(default=None, json_schema_extra={"support": "refused", "neutral": list(neutral), "note": note})


def support(model: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """Field name -> its support entry, for every field of a request model."""
    out = {}
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra
        if not isinstance(extra, dict) or "support" not in extra:
            raise TypeError(f"{model.__name__}.{name} declares no support (use honoured() or refused())")
        out[name] = extra
    return out


def _same(value: Any, neutral: Any) -> bool:
    """Equality without Python's bool == int (`"n": true` is not `"n": 1`)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def refusal(req: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first refused field holding a non-neutral value, or None."""
    for name, meta in support(type(req)).items():
        if meta["support"] != "refused":
            continue
        value = getattr(req, name)
        if value is None or any(_same(value, n) for n in meta["neutral"]):
            continue
        allowed = " or ".join(f"`{_show(n)}`" for n in meta["neutral"])
        only = f" (only {allowed} is accepted)" if allowed else ""
        return name, f"`{name}` is not supported by this server{only}: {meta['note']}"
    return None


def _show(v: Any) -> str:
    import json

    return json.dumps(v, separators=(", ", ": "))


def field_table(chat: type[BaseModel], completion: type[BaseModel]) -> str:
    """The docs' table: one row per field of either endpoint."""
    sc, sp = support(chat), support(completion)
    rows = ["| field | chat | completions | support |", "|---|---|---|---|"]
    for name in sorted(set(sc) | set(sp)):
        meta = sc.get(name) or sp[name]
        if sc.get(name, meta) != meta or sp.get(name, meta) != meta:
            raise TypeError(f"{name}: chat and completions declare it differently")
        if meta["support"] == "honoured":
            what = f"honoured: {meta['note']}"
        else:
            neutral = ", ".join(f"`{_show(n)}`" for n in meta["neutral"])
            what = f"refused{' unless ' + neutral if neutral else ''}: {meta['note']}"
        rows.append(f"| `{name}` | {'✓' if name in sc else ''} | {'✓' if name in sp else ''} | {what} |")
    return "\n".join(rows)


def write_docs_table(path: str) -> None:
    """Replace the field table in a markdown file with the code's (`python -m peagle_cluster.fields FILE`)."""
    from pathlib import Path

    from peagle_cluster.protocol import ChatCompletionRequest, CompletionRequest

    p = Path(path)
    lines = p.read_text().split("\n")
    head = lines.index("| field | chat | completions | support |")
    end = next(i for i in range(head, len(lines)) if not lines[i].startswith("|"))
    table = field_table(ChatCompletionRequest, CompletionRequest).split("\n")
    p.write_text("\n".join(lines[:head] + table + lines[end:]))


if __name__ == "__main__":
    import sys

    write_docs_table(sys.argv[1])
