"""Hostile input at the HTTP edge: body reads that stall, JSON that is too deep or has huge numbers,
strings that cannot be encoded, and echoing what a client sent.

Each check answers a 400 (408 for a stalled body) in OpenAI's error envelope before the request
costs more than a scan of its bytes: Python's `json` recurses per nesting level and refuses
integers past 4,300 digits with a ValueError, so both are bounded before `json.loads` runs.
"""
from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterable

import numpy as np  # a Ray dependency: vectorised bracket depth, no Python loop over a 4 MiB body

from peagle_cluster import protocol as P  # a module reference: protocol imports this module too

MAX_JSON_DEPTH = 64      # OpenAI bodies nest < 10 levels; tool schemas a few more
MAX_NUMBER_DIGITS = 64   # any real float or token id prints in far fewer digits
ECHO_CHARS = 64          # longest client value repeated in an error message

# A string literal once escaped backslashes and quotes are gone, and a run of digits outside strings.
_STRING = re.compile(rb'"[^"]*"')
_LONG_NUMBER = re.compile(rb"[0-9]{%d,}" % (MAX_NUMBER_DIGITS + 1))
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEP = np.array([1 if c in b"[{" else -1 for c in range(256)], dtype=np.int32)  # nesting change per bracket byte


async def read_body(chunks: AsyncIterable[bytes], limit: int, timeout_s: float, declared: str | None) -> bytes:
    """The body, refused with 413 past `limit` bytes and with 408 when it has not arrived in `timeout_s`
    (a client that declares more than it sends must not hold a connection for minutes)."""
    if declared and declared.isdigit() and int(declared) > limit:
        raise P.APIError(413, f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                       code="request_too_large")
    body = bytearray()

    async def read() -> None:
        async for chunk in chunks:  # chunked uploads have no Content-Length: count as we read
            body.extend(chunk)
            if len(body) > limit:
                raise P.APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise P.APIError(408, f"The request body did not arrive within {timeout_s:g} s.", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return bytes(body)


def check_json_shape(raw: bytes) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and numbers longer than MAX_NUMBER_DIGITS, scanning the bytes
    outside string literals (a malformed body passes here and fails in the parser)."""
    bare = _STRING.sub(b'""', raw.replace(b"\\\\", b"").replace(b'\\"', b""))  # C-speed passes, no backtracking
    if _LONG_NUMBER.search(bare):
        raise P.APIError(400, f"The body has a number longer than {MAX_NUMBER_DIGITS} digits.", code="invalid_json")
    brackets = np.frombuffer(bare.translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if brackets.size and int(np.cumsum(_STEP[brackets]).max()) > MAX_JSON_DEPTH:
        raise P.APIError(400, f"The body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json")


def check_strings(data: Any, path: str = "") -> None:
    """A 400 naming the first string (or key) that UTF-8 cannot encode: a lone UTF-16 surrogate such as
    `"\\ud800"` is legal JSON but no tokenizer, log line or response body can carry it."""
    if isinstance(data, str):
        if not _encodable(data):
            raise P.APIError(400, f"{echo(path or 'body')}: the string contains a lone UTF-16 surrogate, which is not "
                                  "valid Unicode text.", param=echo(path) if path else None, code="invalid_value")
    elif isinstance(data, dict):
        for k, v in data.items():
            if not _encodable(k):
                raise P.APIError(400, f"{echo(path or 'body')}: a key contains a lone UTF-16 surrogate.",
                                 param=echo(path) if path else None, code="invalid_value")
            check_strings(v, f"{path}.{k}" if path else k)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            check_strings(v, f"{path}.{i}")


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def echo(value: Any, limit: int = ECHO_CHARS) -> str:
    """A client's value fit for an error message: ASCII with escapes, at most `limit` characters of it."""
    s = str(value)
    cut = s[:limit].encode("ascii", "backslashreplace").decode("ascii")
    return cut + ("..." if len(s) > limit else "")
