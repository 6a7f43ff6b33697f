"""Our harmony rendering against OpenAI's own renderer (`openai-harmony`), offline.

`openai-harmony` loads o200k_base at run time; `bpe-openai` ships the file, which we unzip into a
directory that TIKTOKEN_ENCODINGS_BASE names, so nothing is downloaded. Both are in the `test` extra.
"""
from __future__ import annotations

import pytest

from peagle_core.loading.harmony_tools import tools_section
from peagle_core.loading.tokenizer import apply_chat_template

H = pytest.importorskip("openai_harmony")
pytest.importorskip("bpe_openai")

from gptoss_tokenizer import harmony_encoding  # noqa: E402  (the o200k file, unzipped and checked)


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    with harmony_encoding(tmp_path_factory.mktemp("tiktoken")) as e:
        yield e


WEATHER = {"name": "get_weather", "description": "Get the weather",
           "parameters": {"type": "object", "properties": {
               "location": {"type": "string", "description": "City"},
               "unit": {"type": "string", "enum": ["c", "f"], "default": "c"}}, "required": ["location"]}}
KITCHEN_SINK = {"name": "a", "description": "Two\nlines", "parameters": {"type": "object", "required": ["n"], "properties": {
    "n": {"type": "integer", "description": "count", "default": 3}, "x": {"type": "number"},
    "b": {"type": "boolean", "default": False}, "arr": {"type": "array", "items": {"type": "string"}},
    "any_arr": {"type": "array"}, "obj": {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
    "described": {"type": "object", "description": "an obj", "properties": {
        "k": {"type": "string", "description": "kd"}, "m": {"type": "object", "properties": {"z": {"type": "boolean"}}}}},
    "nullable": {"type": ["string", "null"]}, "free": {"type": "object"},
    "rows": {"type": "array", "items": {"type": "object", "properties": {"q": {"type": "number"}}}},
    "either": {"oneOf": [{"type": "string", "description": "s"}, {"type": "number", "default": 1}], "description": "e"},
    "union": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "int_enum": {"type": "integer", "enum": [1, 2]}}}}
NO_ARGS = {"name": "noargs", "description": "No args"}
EMPTY = {"name": "empty", "parameters": {"type": "object", "properties": {}}}


def harmony_messages(messages: list[dict], tools: list[dict], effort: str, date: str):
    """The same conversation built with openai-harmony's types (reasoning kept after the last user message,
    as gpt-oss's template and our renderer keep it)."""
    M, R = H.Message, H.Role
    system = H.SystemContent.new().with_reasoning_effort(H.ReasoningEffort(effort.capitalize())) \
        .with_conversation_start_date(date)
    out = [M.from_role_and_content(R.SYSTEM, system)]
    lead = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    if lead or tools:
        dev = H.DeveloperContent.new()
        if lead:
            dev = dev.with_instructions("\n\n".join(lead))
        if tools:
            dev = dev.with_function_tools([H.ToolDescription.new(t["name"], t.get("description", ""),
                                                                 parameters=t.get("parameters")) for t in tools])
        out.append(M.from_role_and_content(R.DEVELOPER, dev))
    last_user = max(i for i, m in enumerate(rest) if m["role"] == "user")
    names = {}
    for i, m in enumerate(rest):
        if m["role"] == "user":
            out.append(M.from_role_and_content(R.USER, m["content"]))
        elif m["role"] == "assistant":
            if m.get("reasoning") and i > last_user:
                out.append(M.from_role_and_content(R.ASSISTANT, m["reasoning"]).with_channel("analysis"))
            for c in m.get("tool_calls") or []:
                names[c["id"]] = c["function"]["name"]
                out.append(M.from_role_and_content(R.ASSISTANT, c["function"]["arguments"]).with_channel("commentary")
                           .with_recipient("functions." + c["function"]["name"]).with_content_type("<|constrain|>json"))
            if not m.get("tool_calls"):
                out.append(M.from_role_and_content(R.ASSISTANT, m["content"]).with_channel("final"))
        else:
            name = "functions." + names[m["tool_call_id"]]
            out.append(M.from_author_and_content(H.Author.new(R.TOOL, name), m["content"]).with_channel("commentary")
                       .with_recipient("assistant"))
    return H.Conversation.from_messages(out)


def _call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "system+developer": [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                         {"role": "user", "content": "Hi"}],
    "multi-turn-reasoning": [{"role": "user", "content": "q1"},
                             {"role": "assistant", "content": "a1", "reasoning": "old thoughts"},
                             {"role": "user", "content": "q2"},
                             {"role": "assistant", "content": "a2", "reasoning": "new thoughts"},
                             {"role": "user", "content": "q3"}],
    "tool-results": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in SF and NYC?"},
                     {"role": "assistant", "content": None, "reasoning": "Two calls.",
                      "tool_calls": [_call("c1", "get_weather", '{"location":"SF"}')]},
                     {"role": "tool", "tool_call_id": "c1", "content": '{"t":20}'},
                     {"role": "assistant", "content": None,
                      "tool_calls": [_call("c2", "get_weather", '{"location":"NYC","unit":"f"}')]},
                     {"role": "tool", "tool_call_id": "c2", "content": '{"t":70}'}],
    "tool-then-answer-then-user": [{"role": "user", "content": "Weather?"},
                                   {"role": "assistant", "content": None, "reasoning": "Call it.",
                                    "tool_calls": [_call("c1", "get_weather", '{"location":"SF"}')]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                                   {"role": "assistant", "content": "Sunny."},
                                   {"role": "user", "content": "Thanks"}],
}
TOOLSETS = {"no-tools": [], "weather": [WEATHER], "many": [WEATHER, KITCHEN_SINK, NO_ARGS, EMPTY]}


@pytest.mark.parametrize("tools", TOOLSETS, ids=list(TOOLSETS))
@pytest.mark.parametrize("name", CONVERSATIONS, ids=list(CONVERSATIONS))
@pytest.mark.parametrize("effort", ["low", "high"])
def test_rendering_matches_openai_harmony(enc, name, tools, effort):
    messages, fns = CONVERSATIONS[name], TOOLSETS[tools]
    if name.startswith("tool") and not fns:
        pytest.skip("tool calls without declared tools")
    ours = apply_chat_template(messages, True, effort, tools=fns, current_date="2025-06-28")
    ref = enc.decode_utf8(enc.render_conversation_for_completion(
        harmony_messages(messages, fns, effort, "2025-06-28"), H.Role.ASSISTANT))
    assert ours == ref


def test_tools_section_matches_openai_harmony_schema_by_schema(enc):
    for fn in (WEATHER, KITCHEN_SINK, NO_ARGS, EMPTY):
        dev = H.DeveloperContent.new().with_function_tools(
            [H.ToolDescription.new(fn["name"], fn.get("description", ""), parameters=fn.get("parameters"))])
        ref = enc.decode_utf8(enc.render_conversation(H.Conversation.from_messages(
            [H.Message.from_role_and_content(H.Role.DEVELOPER, dev)])))
        assert ref == f"<|start|>developer<|message|>{tools_section([fn])}<|end|>"

