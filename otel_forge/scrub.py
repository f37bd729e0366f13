"""Credentials never reach a log line, a tag, a param or a file: scrub them out of text."""

from __future__ import annotations

import re
import urllib.parse

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)[^/@\s]+@")
_SECRETS = re.compile(r"(?i)(?P<name>token|password|secret|api[_-]?key|authorization)(?P<sep>[=:]\s*|\s+)"
                      r"(?P<value>(bearer\s+)?[^\s&,;]+)")


def scrub(text: str) -> str:
    """``text`` with URI userinfo and ``token=...``-like values replaced by ``***``."""
    text = _USERINFO.sub(lambda m: f"{m.group('scheme')}***@", text)
    return _SECRETS.sub(lambda m: f"{m.group('name')}{m.group('sep')}***", text)


def uri_without_credentials(uri: str) -> str:
    """The URI with its userinfo removed (not masked): safe to store and to use again."""
    parts = urllib.parse.urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
