"""Credentials never reach a log line, a tag, a param or a file: scrub them out of text, and
redact the values whose key names a secret.

Every pattern has bounded repetition, so scrubbing is linear in the text's length: a huge value
costs time in proportion, never a quadratic stall of the thread (and the GIL) that scrubs it.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

REDACTED = "***"
# A key names a secret when its words (split on `_ . - /` and camelCase) contain one of these
# phrases: `db.password`, `hf_token`, `openai_api_key`, `awsSecretAccessKey`, but not
# `tokenizer` or `max_tokens`. OTEL_FORGE_SECRET_KEYS adds phrases.
SECRET_KEY_WORDS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "credential",
    "credentials",
    "api key",
    "apikey",
    "access key",
    "private key",
    "authorization",
    "auth",
    "cookie",
    "session key",
    "signature",
)

_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]{0,31}://)[^/@\s]{1,512}@")
_SECRETS = re.compile(
    r"(?i)(?P<name>token|password|passwd|secret|api[_-]?key|authorization)"
    r"(?P<sep>\s{0,16}[=:]\s{0,16}|\s{1,16})"
    r"""(?P<value>(bearer\s{1,16})?(?![=:]|["']?\*\*\*)[^\s&,;]{1,4096})"""
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
# key = value, key: value, "key": "value" -- a key of at most 128 characters that starts where a
# word does: inside a long word no position is tried again, so a text costs time linear in its length.
_ASSIGNMENT = re.compile(
    r"""(?P<key>(?<![\w.\-])["']?[A-Za-z_][\w.\-]{0,127}["']?)(?P<sep>\s{0,16}[=:]\s{0,16})"""
    r"""(?P<value>"(?:[^"\\\n]|\\.){0,65536}"|'[^'\n]{0,65536}'|[^\s,#}\]\n]{1,65536})"""
)


# One regex call holds the GIL throughout: long texts are scrubbed in slices of this size, cut at
# a line (else a space), so another thread (the training loop) waits a few ms at most.
SLICE_CHARS = 64 * 1024


def scrub(text: str) -> str:
    """``text`` with URI userinfo and ``token=...``-like values replaced by ``***``."""
    return "".join(_scrub_slice(piece) for piece in _slices(text))


def error_line(error: BaseException) -> str:
    """An error as one line for a log or the terminal: its first line, credentials scrubbed."""
    return scrub((str(error) or type(error).__name__).splitlines()[0])


def _scrub_slice(text: str) -> str:
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    return _SECRETS.sub(lambda m: f"{m.group('name')}{m.group('sep')}{REDACTED}", text)


def _slices(text: str) -> Iterable[str]:
    start = 0
    while len(text) - start > SLICE_CHARS:
        end = start + SLICE_CHARS
        cut = max(text.rfind("\n", start, end), text.rfind(" ", start, end))
        end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end
    yield text[start:]


def key_words(key: str) -> list[str]:
    return [word for word in _WORD_SPLIT.split(_CAMEL.sub("_", key).lower()) if word]


class SecretKeys:
    """Tells whether a config key names a secret (its words contain a secret phrase)."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        phrases = {tuple(key_words(phrase)) for phrase in (*SECRET_KEY_WORDS, *extra)}
        self._phrases = tuple(p for p in phrases if p)

    def __call__(self, key: str) -> bool:
        words = key_words(key)
        return any(
            words[i : i + len(phrase)] == list(phrase)
            for phrase in self._phrases
            for i in range(len(words) - len(phrase) + 1)
        )

    def redact_text(self, text: str) -> str:
        """A config file's text (TOML, YAML, JSON, env) with secret-keyed values and userinfo masked."""

        def assignment(match: re.Match[str]) -> str:
            if not self(match.group("key").strip("\"'")):
                return match.group(0)
            quote = match.group("value")[0] if match.group("value")[0] in "\"'" else ""
            return f"{match.group('key')}{match.group('sep')}{quote}{REDACTED}{quote}"

        return "".join(_scrub_slice(_ASSIGNMENT.sub(assignment, piece)) for piece in _slices(text))


def uri_without_credentials(uri: str) -> str:
    """The URI with its userinfo removed (not masked): safe to store and to use again."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
