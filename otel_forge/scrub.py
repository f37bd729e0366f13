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
MASKED = f'"{REDACTED}"'  # a masked value in a file: quoted, so the file stays valid YAML, TOML or JSON
SHAPE_MARK = "REDACTED"  # a credential found by its shape in a file, wherever it stands (a bare *** is a YAML alias)
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
    r"(?P<sep>[ \t]{0,16}[=:][ \t]{0,16}|[ \t]{1,16})"  # on its own line: a YAML block below is _BLOCK_KEY's
    r"""(?P<value>(bearer\s{1,16})?(?![=:]|\[?["']?\*\*\*)[^\s&,;]{1,4096})"""
)
# Credentials by their shape, wherever they stand: a URL query parameter named like a secret
# (`?token=`, `&sig=`, `X-Amz-Signature=`), AWS access key ids, JWTs, PEM private-key blocks (to
# their END line, or to the end of their base64 body when the text was cut inside one).
_QUERY_SECRET = re.compile(
    r"(?i)(?P<lead>[?&;](?:[\w.\-]{0,64}[_.\-])?"
    r"(?:token|key|apikey|sig|signature|password|passwd|secret|auth|credential)(?:[_.\-][\w.\-]{0,64})?=)"
    r"(?P<value>[^&#\s\"']{1,4096})"
)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")
_JWT = re.compile(r"\beyJ[\w\-]{4,4096}\.eyJ[\w\-]{4,8192}\.[\w\-]{0,4096}")
_PEM = re.compile(
    r"-----BEGIN (?P<kind>[A-Z ]{0,40}PRIVATE KEY)-----"
    r"(?:[\s\S]{0,16384}?-----END [A-Z ]{0,40}PRIVATE KEY-----|[A-Za-z0-9+/=\s\\n]{0,16384})"
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_WORD_SPLIT = re.compile(r"[^a-z0-9]+")
# key = value, key: value, "key": "value" -- a key of at most 128 characters that starts where a
# word does: inside a long word no position is tried again, so a text costs time linear in its length.
# The value on the key's own line (an inline list whole): a block below the key is _BLOCK_KEY's.
_ASSIGNMENT = re.compile(
    r"""(?P<key>(?<![\w.\-])["']?[A-Za-z_][\w.\-]{0,127}["']?)(?P<sep>[ \t]{0,16}[=:][ \t]{0,16})"""
    r"""(?P<value>\[[^\]\n]{0,65536}\]|"(?:[^"\\\n]|\\.){0,65536}"|'[^'\n]{0,65536}'|[^\s,#{}\[\]\n][^\s,#}\]\n]{0,65535})"""
)
# ["--api-key", "v"] on one line of a file: the value after a flag that names a secret.
_FLAG_VALUE = re.compile(
    r"""(?P<flag>["']--?(?P<name>[A-Za-z][\w.\-]{0,127})["'][ \t]{0,16},[ \t]{0,16})"""
    r"""(?P<quote>["'])[^"'\n]{0,4096}(?P=quote)"""
)
# A YAML key whose value is the block below it (`api_keys:` then `  - a`): the block is masked.
_BLOCK_KEY = re.compile(
    r"""^(?P<indent>[ ]{0,128})(?:- )?["']?(?P<key>[A-Za-z_][\w.\-]{0,127})["']?[ \t]{0,16}:[ \t]*$"""
)
_BLOCK_ITEM = re.compile(r"""^(?P<lead>[ ]{0,256}(?:- |[^:\n]{1,256}:[ \t]{1,16}))(?P<value>\S.*)$""")


# One regex call holds the GIL throughout: long texts are scrubbed in slices of this size, cut at
# a line (else a space), so another thread (the training loop) waits a few ms at most.
SLICE_CHARS = 64 * 1024


def scrub(text: str) -> str:
    """``text`` with URI userinfo and ``token=...``-like values replaced by ``***``."""
    return "".join(_scrub_slice(piece) for piece in _slices(text))


def error_line(error: BaseException) -> str:
    """An error as one line for a log or the terminal: its first line, credentials scrubbed."""
    return scrub((str(error) or type(error).__name__).splitlines()[0])


def _scrub_slice(text: str, shape_mark: str = REDACTED) -> str:
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m.group('lead')}{REDACTED}", text)
    text = _PEM.sub(lambda m: f"-----BEGIN {m.group('kind')}-----{REDACTED}-----END {m.group('kind')}-----", text)
    text = _JWT.sub(shape_mark, _AWS_KEY_ID.sub(shape_mark, text))
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
            first = match.group("value")[0]
            # Quoted: a bare *** is a YAML alias, and no TOML or JSON value.
            masked = f'["{REDACTED}"]' if first == "[" else f"{first}{REDACTED}{first}" if first in "\"'" else MASKED
            return f"{match.group('key')}{match.group('sep')}{masked}"

        def flag_value(match: re.Match[str]) -> str:
            if not self(match.group("name")):
                return match.group(0)
            return f"{match.group('flag')}{match.group('quote')}{REDACTED}{match.group('quote')}"

        text = _FLAG_VALUE.sub(flag_value, self._mask_blocks(text))
        return "".join(_scrub_slice(_ASSIGNMENT.sub(assignment, piece), SHAPE_MARK) for piece in _slices(text))

    def _mask_blocks(self, text: str) -> str:
        """Every value in the indented block under a secret-named YAML key (`- item`, `sub: value`)."""
        lines = text.split("\n")
        block_indent: int | None = None  # inside a secret key's block: the key's indent
        for index, line in enumerate(lines):
            indent = len(line) - len(line.lstrip(" "))
            in_block = (
                block_indent is not None
                and line.strip()
                and (indent > block_indent or (indent == block_indent and line.lstrip().startswith("- ")))
            )
            if in_block:
                lines[index] = _BLOCK_ITEM.sub(lambda m: f"{m.group('lead')}{MASKED}", line)
                continue
            if line.strip():
                block_indent = None
            if (key := _BLOCK_KEY.match(line)) is not None and self(key.group("key")):
                block_indent = len(key.group("indent"))
        return "\n".join(lines)


def uri_without_credentials(uri: str) -> str:
    """The URI with its userinfo and secret-named query parameters removed (not masked): safe to
    store and to use again."""
    parts = urllib.parse.urlsplit(uri)
    secret_query = bool(parts.query) and _QUERY_SECRET.search(f"?{parts.query}") is not None
    if parts.username is None and parts.password is None and not secret_query:
        return uri  # as given: urlunsplit would turn sqlite:////abs into sqlite://abs
    if secret_query:
        # A query parameter named like a secret (`?token=`) goes too.
        kept = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if not _QUERY_SECRET.search(f"?{k}=x")]
        parts = parts._replace(query=urllib.parse.urlencode(kept))
    if parts.username is None and parts.password is None:
        return urllib.parse.urlunsplit(parts)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
