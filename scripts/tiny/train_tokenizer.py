"""Train the tiny model's tokenizer: byte-level BPE in GPT-OSS's style, 8192 ids including specials.

Like o200k_harmony: the o200k pre-tokenization regex, byte-level pieces (every byte sequence encodes,
nothing is <unk>), no normaliser, no BOS added, and harmony's special tokens as single ids, plus
`<|reserved_mask|>` for P-EAGLE's MASK slots. Chats are rendered with the harmony template before
training, so role names and the system-message lines get their own merges.

    python scripts/tiny/train_tokenizer.py --corpus /work/data/tiny_corpus.jsonl --sample-mb 24
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from peagle_core.loading.tokenizer import (  # noqa: E402
    CALL, ENDOFTEXT, HARMONY_SPECIAL_TOKENS, RETURN, STARTOFTEXT, apply_chat_template,
)

MASK_TOKEN = "<|reserved_mask|>"
SPECIAL_TOKENS = list(HARMONY_SPECIAL_TOKENS) + [MASK_TOKEN]
# o200k's split: letter runs with an optional leading non-letter and English contractions, 1-3 digit runs,
# punctuation runs (with trailing newlines or '/'), newline runs, then other whitespace.
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
DEFAULT_OUT = REPO / "peagle_core" / "assets" / "tiny"


def document_text(doc: dict) -> str:
    """A corpus line as the model sees it: chats in harmony format, code as is."""
    if "messages" in doc:
        return apply_chat_template(doc["messages"], add_generation_prompt=False)
    if "text" in doc:
        return doc["text"]
    raise ValueError(f"corpus line has neither 'messages' nor 'text': keys {sorted(doc)}")


def sample_documents(corpus: Path, sample_mb: float, seed: int) -> list[str]:
    """A seeded random sample of the corpus, about `sample_mb` MB of rendered text."""
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} not found; build it with scripts/tiny/corpus.py --out {corpus}")
    # split on "\n" only: str.splitlines would also cut at U+2028 inside JSON strings
    lines = [l for l in corpus.read_text(encoding="utf-8").split("\n") if l.strip()]
    random.Random(seed).shuffle(lines)
    out, total, budget = [], 0, int(sample_mb * 1e6)
    for line in lines:
        if total >= budget:
            break
        text = document_text(json.loads(line))
        out.append(text)
        total += len(text.encode("utf-8"))
    return out


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )

    def batches() -> Iterator[list[str]]:
        for i in range(0, len(docs), 256):
            yield docs[i:i + 256]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(docs))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"trained vocabulary has {got} ids, wanted {vocab_size}: use a larger --sample-mb")
    return tok


def write_configs(tok: Tokenizer, out: Path, model_max_length: int) -> dict:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    gen = {"bos_token_id": ids[STARTOFTEXT], "eos_token_id": [ids[RETURN], ids[ENDOFTEXT], ids[CALL]],
           "pad_token_id": ids[ENDOFTEXT]}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": STARTOFTEXT,
        "eos_token": RETURN,
        "pad_token": ENDOFTEXT,
        "mask_token": MASK_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return ids


# Jinja version of peagle_core.loading.tokenizer.apply_chat_template (no tools), for transformers users.
CHAT_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06"
    "{%- if current_date is defined and current_date %}{{ '\\nCurrent date: ' + current_date }}{% endif %}"
    "{{- '\\n\\nReasoning: ' + effort + '\\n\\n' -}}"  # an expression: trim_blocks eats a newline after a tag
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- set ns = namespace(lead=true, instr=[]) -%}"
    "{%- for m in messages -%}"
    "{%- set text = m.content if m.content is string else (m.content | map(attribute='text') | join('\n')) -%}"
    "{%- if ns.lead and m.role in ['system', 'developer'] -%}"
    "{%- if text | trim -%}{%- set ns.instr = ns.instr + [text] -%}{%- endif -%}"
    "{%- else -%}"
    "{%- if ns.lead and ns.instr -%}<|start|>developer<|message|># Instructions\n\n{{ ns.instr | join('\n\n') }}<|end|>"
    "{%- endif -%}"
    "{%- set ns.lead = false -%}"
    "{%- if m.role in ['system', 'developer'] -%}<|start|>developer<|message|># Instructions\n\n{{ text }}<|end|>"
    "{%- elif m.role == 'user' -%}<|start|>user<|message|>{{ text }}<|end|>"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ text }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ m.name or 'tool' }} to=assistant<|channel|>commentary"
    "<|message|>{{ text }}<|end|>"
    "{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.lead and ns.instr -%}<|start|>developer<|message|># Instructions\n\n{{ ns.instr | join('\n\n') }}<|end|>"
    "{%- endif -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def record(corpus_md: Path, text: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from corpus import TOKENIZER_MARK_BEGIN, TOKENIZER_MARK_END

    if not corpus_md.is_file():
        print(f"note: {corpus_md} does not exist; tokenizer record not written")
        return
    old = corpus_md.read_text(encoding="utf-8")
    if TOKENIZER_MARK_BEGIN not in old or TOKENIZER_MARK_END not in old:
        old += f"\n## Tokenizer\n\n{TOKENIZER_MARK_BEGIN}\n{TOKENIZER_MARK_END}\n"
    head, rest = old.split(TOKENIZER_MARK_BEGIN, 1)
    tail = rest.split(TOKENIZER_MARK_END, 1)[1]
    corpus_md.write_text(f"{head}{TOKENIZER_MARK_BEGIN}\n{text}\n{TOKENIZER_MARK_END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("/work/data/tiny_corpus.jsonl"))
    ap.add_argument("--sample-mb", type=float, default=24.0, help="MB of rendered text to train on")
    ap.add_argument("--vocab-size", type=int, default=8192, help="ids in all, special tokens included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-max-length", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--corpus-md", type=Path, default=DEFAULT_OUT / "CORPUS.md")
    args = ap.parse_args(argv)

    t0 = time.time()
    try:
        docs = sample_documents(args.corpus, args.sample_mb, args.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    print(f"training on {len(docs)} documents, {n_bytes / 1e6:.1f} MB")
    tok = train(docs, args.vocab_size)
    seconds = time.time() - t0

    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=False)
    ids = write_configs(tok, args.out, args.model_max_length)

    # Check on the sample: lossless round trip, compression, specials are single ids.
    check = docs[:200]
    n_tok = sum(len(tok.encode(d, add_special_tokens=False).ids) for d in check)
    n_chr = sum(len(d.encode("utf-8")) for d in check)
    bad = sum(tok.decode(tok.encode(d, add_special_tokens=False).ids, skip_special_tokens=False) != d for d in check)
    if bad:
        raise RuntimeError(f"{bad} of {len(check)} documents do not round-trip")
    size = (args.out / "tokenizer.json").stat().st_size
    print(f"vocab {tok.get_vocab_size()} ids, {size / 1e3:.0f} kB tokenizer.json, {n_chr / n_tok:.2f} bytes/token, "
          f"trained in {seconds:.0f} s")
    cmd = "python scripts/tiny/train_tokenizer.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record(args.corpus_md, "\n".join([
        f"- Command: `{cmd.strip()}`",
        f"- Byte-level BPE (`tokenizers`), o200k pre-tokenization regex, {tok.get_vocab_size()} ids incl. "
        f"{len(SPECIAL_TOKENS)} special tokens, min merge frequency 2",
        f"- Trained on a seeded sample (seed {args.seed}) of {len(docs):,} corpus documents, {n_bytes:,} bytes of "
        f"harmony-rendered text, in {seconds:.0f} s",
        f"- Compression on 200 sample documents: {n_chr / n_tok:.2f} bytes per token; tokenizer.json {size:,} bytes",
        "- Special token ids: " + ", ".join(f"`{t}` {i}" for t, i in ids.items()),
        f"- generation_config.json: eos_token_id = [{ids[RETURN]}, {ids[ENDOFTEXT]}, {ids[CALL]}] "
        f"(`<|return|>`, `<|endoftext|>`, `<|call|>`), bos `<|startoftext|>`, pad `<|endoftext|>`; "
        f"P-EAGLE mask token `{MASK_TOKEN}` = {ids[MASK_TOKEN]}",
    ]))
    print(f"wrote {args.out}/tokenizer.json, tokenizer_config.json, generation_config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
