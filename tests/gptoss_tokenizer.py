"""The real GPT-OSS tokenizer, built offline: o200k_base (shipped by `bpe-openai`) plus harmony's special tokens.

`openai-harmony`'s HARMONY_GPT_OSS encoding is o200k_base's ranks, o200k's split pattern, and 1,091 special
tokens from id 199998 on. We write the same vocabulary as a Hugging Face `tokenizer.json` (byte-level BPE,
as GPT-OSS checkpoints ship it), with the `generation_config.json` and `tokenizer_config.json` of the
published checkpoints, so the engine loads it through the code a real checkpoint goes through.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's own
# o200k_base's pre-tokenizer pattern (tiktoken's)
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# What openai/gpt-oss-20b and -120b ship beside tokenizer.json
GENERATION_CONFIG = {"bos_token_id": 199998, "eos_token_id": [200002, 199999, 200012], "pad_token_id": 199999}
TOKENIZER_CONFIG = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}


def o200k_bytes() -> bytes:
    """The unzipped o200k_base.tiktoken that `bpe-openai` ships, checked against tiktoken's hash."""
    import bpe_openai

    data = gzip.decompress((Path(bpe_openai.__file__).parent / "data" / "o200k_base.tiktoken.gz").read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise ValueError("bpe-openai's o200k_base.tiktoken is not tiktoken's")
    return data


@contextmanager
def harmony_encoding(directory: Path):
    """openai-harmony's HARMONY_GPT_OSS encoding, loaded from `directory` with no network."""
    import openai_harmony as H

    (directory / "o200k_base.tiktoken").write_bytes(o200k_bytes())
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        yield H.load_harmony_encoding(H.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's alphabet, byte -> character (the inverse of the tokenizer module's table)."""
    from peagle_core.loading.tokenizer import _BYTE_OF_CHAR

    return {b: c for c, b in _BYTE_OF_CHAR.items()}


def tokenizer_json(special_tokens: dict[str, int]) -> dict:
    """o200k_base as a `tokenizers` byte-level BPE, plus `special_tokens` (name -> id) as added tokens.

    tiktoken merges, anywhere in a piece, the adjacent pair whose concatenation has the lowest rank, and
    returns a piece that is itself a token whole. The BPE below lists every split of every token into two
    tokens, ranked by the token they make (`ignore_merges` returns whole tokens first), which is that rule."""
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in o200k_bytes().splitlines())}
    chars = _byte_chars()
    text = {b: "".join(chars[x] for x in b) for b in ranks}
    merges = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], text[left], text[right]))
    merges.sort()
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for name, i in sorted(special_tokens.items(), key=lambda kv: kv[1])]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": O200K_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text[b]: r for b, r in ranks.items()},
                  "merges": [[a, b] for _, _, a, b in merges]},
    }


def write_gptoss_tokenizer(directory: Path, encoding) -> Path:
    """tokenizer.json (harmony's special tokens, ids included), generation_config.json and tokenizer_config.json
    of a GPT-OSS checkpoint, into `directory`."""
    special = {name: encoding.encode(name, allowed_special="all")[0] for name in encoding.special_tokens_set}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(special), ensure_ascii=False))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory
