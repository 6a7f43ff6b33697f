"""The regeneration prompts `scripts/tiny/prepare_data.py` draws for drafter training: chat turns with their
history and prompts cut inside documented functions, on a corpus written here."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prepare_data():
    spec = importlib.util.spec_from_file_location("tiny_prepare_data", ROOT / "scripts/tiny/prepare_data.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


CHAT = {"messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": "first question?"},
                     {"role": "assistant", "content": "first answer " + "a" * 1500},
                     {"role": "user", "content": "second question?"},
                     {"role": "assistant", "content": "second answer " + "b" * 700},
                     {"role": "user", "content": "third question?"},
                     {"role": "user", "content": "hi"}]}  # too short to be a prompt

SOURCE = "import os\n\n" + "".join(
    f'def f{i}(x):\n    \"\"\"Function number {i}, documented.\"\"\"\n' + "".join(f"    x = x + {j}\n" for j in range(9))
    + "    return x\n\n\n" for i in range(2))


def test_chat_prompts_are_the_first_user_turns_without_history():
    mod = prepare_data()
    got = mod.chat_prompts(CHAT, turns=2, with_history=False)
    assert got == [{"messages": [{"role": "user", "content": "first question?"}]},
                   {"messages": [{"role": "user", "content": "second question?"}]}]


def test_chat_prompts_with_history_end_at_a_later_turn_and_open_with_a_user_turn():
    mod = prepare_data()
    got = mod.chat_prompts(CHAT, turns=12, with_history=True)
    assert [p["messages"][-1]["content"] for p in got] == ["second question?", "third question?"]
    convo = [m for m in CHAT["messages"] if m["role"] != "system"]
    for p in got:
        msgs = p["messages"]
        assert msgs[0]["role"] == "user"
        start = convo.index(msgs[0])
        assert msgs == convo[start:start + len(msgs)]  # a contiguous stretch of the chat, in order
    # the second turn keeps the first exchange (1.5 k characters); the third drops it: it would pass ~2 k
    assert got[0]["messages"][0]["content"] == "first question?"
    assert got[1]["messages"][0]["content"] == "second question?"
    # a cut that would open on an assistant reply drops it
    chat = {"messages": [{"role": "user", "content": "first question?"},
                         {"role": "assistant", "content": "c" * 1975}, {"role": "user", "content": "second question?"}]}
    assert mod.chat_prompts(chat, turns=12, with_history=True) == [{"messages": [chat["messages"][2]]}]


def test_body_prompts_stop_one_to_eight_lines_into_a_documented_function(tmp_path):
    mod = prepare_data()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": SOURCE}) + "\n" + json.dumps(CHAT) + "\n")
    got = mod.body_prompts(corpus, 100, random.Random(0))
    assert len(got) == 4  # two cuts into each of the two functions (the chat has no source)
    cuts = set()
    for p in got:
        text = p["text"]
        assert text in SOURCE and text.endswith("\n")  # real source, cut at a line's end
        body = text.rsplit('documented."""\n', 1)[1]
        assert 1 <= body.count("\n") <= 8 and all(line.startswith("    x = x + ") for line in body.splitlines())
        cuts.add((text.count("def f1"), body.count("\n")))
    assert len(cuts) == 4  # two different depths in each function


def test_no_body_prompts_draw_nothing_from_the_generator(tmp_path):
    mod = prepare_data()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"text": SOURCE}) + "\n")
    rng = random.Random(0)
    state = rng.getstate()
    assert mod.body_prompts(corpus, 0, rng) == []
    assert rng.getstate() == state  # the default prompt set stays what it was
