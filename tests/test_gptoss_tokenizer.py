"""The 20B/120B configs' text path with the real GPT-OSS tokenizer (o200k + harmony's special tokens), offline.

The tokenizer is built from the o200k_base file `bpe-openai` ships (tests/gptoss_tokenizer.py) into a checkpoint
directory with GPT-OSS's vocabulary size and a tiny random model, and loaded by the engine as a real checkpoint
is. Oracles: openai-harmony's encoding (token ids of texts and of rendered conversations) and the tokenizer's
own `decode` of all ids (what every stream must add up to).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from peagle_core import LLM, SamplingParams
from peagle_core.engine.llm_engine import load_tokenizer
from peagle_core.loading.tokenizer import IncrementalDetokenizer, StopFilter
from peagle_core.testing import build_target, tiny_target_config

H = pytest.importorskip("openai_harmony")
pytest.importorskip("bpe_openai")

from gptoss_tokenizer import GENERATION_CONFIG, harmony_encoding, write_gptoss_tokenizer  # noqa: E402
from test_harmony_reference import CONVERSATIONS, TOOLSETS, harmony_messages  # noqa: E402
from test_tokenizer import _stream  # noqa: E402

GPTOSS_VOCAB = 201088  # config.json of openai/gpt-oss-20b and -120b
MULTIBYTE = ["😀 emoji 🇺🇸👨‍👩‍👧‍👦!", "中文的文本，还有标点。", "日本語のテキストです", "한국어 텍스트", "Ünïcödé façade — “quotes”",
             "mixed 中文 and 😀😀😀 and Ελληνικά and العربية"]
TEXTS = MULTIBYTE + ["Hello World!! I'm here  \n\n  x", "def f(x):\n\treturn x**2  # ok\r\n", "1234567 3.14159e-3",
                     "   leading spaces", "ALL CAPS, it's, WE'LL; they'VE", "<|start|>user<|message|>hi<|end|>"]


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    with harmony_encoding(tmp_path_factory.mktemp("tiktoken")) as e:
        yield e


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, enc):
    """A GPT-OSS checkpoint directory: the real tokenizer files and a tiny random model of GPT-OSS's vocabulary."""
    d = tmp_path_factory.mktemp("gptoss")
    write_gptoss_tokenizer(d, enc)
    cfg = tiny_target_config(vocab_size=GPTOSS_VOCAB, eos_token_id=GENERATION_CONFIG["eos_token_id"],
                             pad_token_id=GENERATION_CONFIG["pad_token_id"])
    build_target(d, cfg, seed=0, scale=4.0)
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)  # the engine's loader


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), max_model_len=512, max_num_seqs=4)


def _random_text(rng: random.Random) -> str:
    pools = ["abcXYZ ", "0123456789", " \n\t\r", "!?.,;:'\"()[]{}<>/\\-_=+*&^%$#@", "中文日本語한국어", "😀🇺🇸👍🏽‍", "éüßçñ"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40)))


def test_the_loaded_tokenizer_is_gptoss(tok, enc):
    assert tok.vocab_size == len(enc.special_tokens_set) + 199998
    assert tok.stop_token_ids == [200002, 199999, 200012]
    assert tok.eos_token_id == 200002 and tok.bos_token_id == 199998 and tok.pad_token_id == 199999
    for name in enc.special_tokens_set:
        assert tok.token_id(name) == enc.encode(name, allowed_special="all")[0]
    assert tok.token_bytes(True) is not None  # streams decode bytewise, as on a real checkpoint


def test_encode_and_decode_match_o200k(tok, enc):
    rng = random.Random(0)
    for text in TEXTS + [_random_text(rng) for _ in range(300)]:
        ids = tok.encode(text)
        assert ids == enc.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.encode(text, allow_special=False) == enc.encode(text, disallowed_special=())


@pytest.mark.parametrize("tools", TOOLSETS, ids=list(TOOLSETS))
@pytest.mark.parametrize("name", CONVERSATIONS, ids=list(CONVERSATIONS))
def test_chat_prompt_token_ids_match_openai_harmony(tok, enc, name, tools):
    messages, fns = CONVERSATIONS[name], TOOLSETS[tools]
    if name.startswith("tool") and not fns:
        pytest.skip("tool calls without declared tools")
    ours = tok.apply_chat_template(messages, True, "medium", tools=fns, current_date="2025-06-28", tokenize=True)
    ref = enc.render_conversation_for_completion(harmony_messages(messages, fns, "medium", "2025-06-28"),
                                                 H.Role.ASSISTANT)
    assert ours == list(ref)


def test_llm_chat_prompt_is_openai_harmony_s(llm, enc):
    from peagle_core.loading.tokenizer import today

    messages = CONVERSATIONS["multi-turn-reasoning"]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2))[0]
    assert out.prompt_token_ids == list(enc.render_conversation_for_completion(
        harmony_messages(messages, [], "medium", today()), H.Role.ASSISTANT))


@pytest.mark.parametrize("bytewise", [True, False])
def test_streamed_multibyte_text_adds_up_to_decode_whatever_the_split(tok, bytewise):
    rng = random.Random(1)
    # some tokens end inside a character
    assert any("\ufffd" in tok.decode([i]) for text in MULTIBYTE for i in tok.encode(text))
    for text in MULTIBYTE:
        for _ in range(5):
            deltas = _stream(tok, tok.encode(text), rng, bytewise=bytewise)
            assert "".join(deltas) == text
            assert not any("\ufffd" in x for x in deltas)  # a character is sent whole, once complete


def test_stop_strings_cut_multibyte_text_at_the_first_match(tok):
    rng = random.Random(2)
    text = MULTIBYTE[-1]
    ids = tok.encode(text)
    for stop in ["中文", "😀😀", "Ελ", "ة", "and 😀"]:
        for include in (False, True):
            d, f, sent = IncrementalDetokenizer(tok), StopFilter([stop], include), []
            i = 0
            while i < len(ids) and not f.stopped:
                n = rng.randint(1, 2)
                sent.append(f.push(d.push(ids[i:i + n]), final=False))
                i += n
            sent.append(f.push(d.flush(), final=True))
            cut = text.index(stop) + (len(stop) if include else 0)
            assert f.stopped and "".join(sent) == text[:cut]


def test_engine_streams_multibyte_text_and_stops_on_it(llm, tok):
    """A random model biased to multi-byte pieces: the engine's streamed deltas add up to the final text,
    which is decode(ids) cut at the stop string (greedy, so the run without a stop is the oracle)."""
    pieces = sorted({i for t in MULTIBYTE for i in tok.encode(t)})
    bias = {i: 100.0 for i in pieces}
    base = SamplingParams(temperature=0, max_tokens=24, logit_bias=bias, ignore_eos=True)
    full = llm.generate("Say something:", base)[0].outputs[0]
    assert set(full.token_ids) <= set(pieces) and full.text == tok.decode(full.token_ids)
    chars = [c for c in full.text if ord(c) > 127 and c != "\ufffd"]
    assert chars, full.text
    stop = full.text[full.text.index(chars[len(chars) // 2]):][:2]  # from the middle, multi-byte first
    for include in (False, True):
        p = SamplingParams(**{**base.__dict__, "stop": [stop], "include_stop_str_in_output": include})
        cut = full.text.index(stop) + (len(stop) if include else 0)
        out = llm.generate("Say something:", p)[0].outputs[0]
        assert out.text == full.text[:cut] and out.finish_reason == "stop"
        streamed = _engine_deltas(llm, "Say something:", p)
        assert "".join(streamed) == out.text


def _engine_deltas(llm, prompt, params) -> list[str]:
    """The engine's per-step text deltas for one request."""
    engine = llm.engine
    req = engine.add_request("stream-test", prompt, params)
    deltas = []
    while not req.finished:
        deltas += [u.new_text for u in engine.step() if u.req is req]
    return deltas


# --------------------------------------------------------------------------------------------
# The 20B and 120B serve configs, as shipped but for the checkpoint (this one) and the device (the CPU)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gpt-oss-20b.yaml", "gpt-oss-120b.yaml"])
def served(request, ckpt, tmp_path_factory):
    """The config's application args with `model`, `tokenizer` and the drafter pointing at local checkpoints of
    GPT-OSS's vocabulary, run in-process by a replica and the router (tests/test_cluster_app.py's harness)."""
    import yaml

    from peagle_cluster.replica import EngineServer
    from peagle_cluster.router import Frontend, install_frontend
    from peagle_cluster.settings import parse_app_args
    from peagle_core.testing import build_drafter
    from test_cluster_app import KEY, LocalHandle, Loop

    drafter = tmp_path_factory.mktemp("drafter")
    build_drafter(drafter, tiny_target_config(vocab_size=GPTOSS_VOCAB), parallel=True)
    config = Path(__file__).resolve().parents[1] / "configs" / request.param
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    name = args["model"]  # served under the config's name
    args |= {"served_model_name": name, "model": str(ckpt), "tokenizer": str(ckpt), "device": "cpu", "dtype": "float32", "max_model_len": 512,
             "max_num_seqs": 4, "max_num_batched_tokens": 512, "api_key": KEY}
    args["speculative_config"] = args["speculative_config"] | {"model": str(drafter), "num_speculative_tokens": 3}
    settings = parse_app_args(args)
    loop = Loop()
    server = loop.run(_make_server(EngineServer, Frontend, install_frontend, LocalHandle, settings))
    yield loop, name
    server.shutdown()
    loop.close()


async def _make_server(EngineServer, Frontend, install_frontend, LocalHandle, settings):
    server = EngineServer(settings.model_dump(), replica_id="gptoss-config")
    install_frontend(Frontend(settings, LocalHandle(server)))
    return server


def test_the_configs_text_path_with_the_gptoss_tokenizer(served, enc):
    """Through the openai client: the prompt the server counts is openai-harmony's rendering; multi-byte text
    in and out; streamed chat deltas add up to the whole reply; /tokenize and /detokenize are o200k's."""
    import openai
    import httpx

    from peagle_core.loading.tokenizer import today
    from peagle_cluster.router import api
    from test_cluster_app import KEY

    def client():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://peagle/v1")
        return openai.AsyncOpenAI(base_url="http://peagle/v1", api_key=KEY, http_client=http, max_retries=0)

    messages = [{"role": "system", "content": "回答要简短 😀"}, {"role": "user", "content": "日本語で答えて: 🇺🇸?"}]
    want = enc.render_conversation_for_completion(harmony_messages(messages, [], "medium", today()), H.Role.ASSISTANT)
    loop, name = served
    kw = dict(model=name, messages=messages, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})

    async def go():
        async with client() as c:
            whole = await c.chat.completions.create(**kw)
            chunks = [ch async for ch in await c.chat.completions.create(**kw, stream=True)]
            tokens = await c.post("/../tokenize", cast_to=object, body={"prompt": MULTIBYTE[-1]})
            text = await c.post("/../detokenize", cast_to=object, body={"tokens": tokens["tokens"]})
            return whole, chunks, tokens, text

    whole, chunks, tokens, text = loop.run(go())
    assert whole.usage.prompt_tokens == len(want) and whole.usage.completion_tokens == 24
    m = whole.choices[0].message
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reasoning = "".join(ch.choices[0].delta.model_extra.get("reasoning") or "" for ch in chunks if ch.choices)
    assert (streamed, reasoning) == (m.content or "", m.model_extra.get("reasoning") or "")
    assert tokens["tokens"] == enc.encode(MULTIBYTE[-1], allowed_special="all") and text["prompt"] == MULTIBYTE[-1]
