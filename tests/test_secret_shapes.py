"""Credentials masked by their shape as well as by their key name, and a masked config file that
stays a valid file of its format (parsed back here): what a launch file, a param, a log line or a
spool header may hold of a secret is nothing."""

from __future__ import annotations

import json

import pytest
import yaml

try:
    import tomllib
except ImportError:  # Python 3.10: the package's own dependency, tomli, is the same parser
    import tomli as tomllib

from otel_forge.mlflow.training.run_metadata import redact
from otel_forge.scrub import SecretKeys, scrub, uri_without_credentials

AWS_KEY_ID = "AKIAIOSFODNN7EXAMPLE"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7secretbody\nq8Zx==\n-----END RSA PRIVATE KEY-----"
SECRETS = ("tok-123", "nested-secret-1", "nested-secret-2", "hunter2", "flag-secret", AWS_KEY_ID, JWT, "secretbody")


@pytest.mark.parametrize(
    "text",
    [
        "https://mlflow.example/api?token=tok-123&workspace=1",
        "GET /x?X-Amz-Signature=tok-123&X-Amz-Credential=tok-123 200",
        f"key id {AWS_KEY_ID} in a message",
        f"Bearer {JWT}",
        f"config: {PEM}",
        f"cut inside: {PEM[:60]}",  # a text cut inside the block (a 64 KiB slice, a truncated value)
    ],
)
def test_a_credential_is_masked_by_its_shape(text) -> None:
    masked = scrub(text)
    assert not [secret for secret in SECRETS if secret in masked], masked


def test_words_that_merely_contain_a_secret_word_are_kept() -> None:
    text = "?page=2&keyboard=qwerty tokenizer=bert max_tokens=512"
    assert scrub(text) == text


def test_a_tracking_uri_is_stored_without_its_token_and_still_usable() -> None:
    assert (
        uri_without_credentials("https://u:p@h:5000/path?token=tok-123&workspace=1")
        == "https://h:5000/path?workspace=1"
    )


def test_the_value_after_a_secret_named_flag_in_a_list_is_masked() -> None:
    masked = redact({"args": ["--api-key", "flag-secret", "--lr", "0.1", "--hf-token=flag-secret"]}, SecretKeys())
    assert masked == {"args": ["--api-key", "***", "--lr", "0.1", "--hf-token=***"]}


YAML = f"""\
model:
  dim: 8
api_key:
  - nested-secret-1
  - nested-secret-2
db:
  password: hunter2
  host: db.local
aws: {AWS_KEY_ID}
args: ["--api-key", "flag-secret", "--lr", "0.1"]
lr: 0.1
"""
TOML = f"""\
api_key = ["nested-secret-1", "nested-secret-2"]
lr = 0.1
args = ["--hf-token", "flag-secret"]
[db]
password = "hunter2"
aws = "{AWS_KEY_ID}"
"""
JSON = json.dumps(
    {"api_key": "hunter2", "nested": {"token": ["nested-secret-1"]}, "args": ["--api-key", "flag-secret"], "lr": 1}
)


@pytest.mark.parametrize(
    ("text", "parse"), [(YAML, yaml.safe_load), (TOML, tomllib.loads), (JSON, json.loads)], ids=["yaml", "toml", "json"]
)
def test_a_masked_config_file_is_still_valid_and_holds_no_secret(text, parse) -> None:
    masked = SecretKeys().redact_text(text)
    parsed = parse(masked)  # raises if the masking broke the file
    assert not [secret for secret in SECRETS if secret in masked], masked
    assert parsed.get("lr") in (0.1, 1)  # what is not a secret is kept
