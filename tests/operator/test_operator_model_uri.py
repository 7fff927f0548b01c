"""Model URIs: what each scheme names, and clear errors for what it cannot deliver."""

from __future__ import annotations

import pytest
from kvfleet.operator.model_uri import ModelSource, ModelURIError, parse_model_uri


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://Qwen/Qwen3-0.6B", ModelSource("hf", "Qwen/Qwen3-0.6B", None)),
        ("hf://meta-llama/Llama-3.1-8B@main", ModelSource("hf", "meta-llama/Llama-3.1-8B", "main")),
        ("hf://org/name@refs/pr/3", ModelSource("hf", "org/name", "refs/pr/3")),
        ("pvc://models/qwen/8b", ModelSource("pvc", "models", "qwen/8b")),
        ("pvc://models/qwen//8b/", ModelSource("pvc", "models", "qwen/8b")),
        ("pvc://models", ModelSource("pvc", "models", "")),
        ("file:///var/lib/models/tiny", ModelSource("file", "/var/lib/models/tiny")),
        ("file:///opt/m/./tiny/", ModelSource("file", "/opt/m/tiny")),
    ],
)
def test_valid_uris(uri: str, expected: ModelSource) -> None:
    assert parse_model_uri(uri) == expected


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket/model", "scheme must be"),
        ("hf://only-name", "hf://<org>/<name>"),
        ("hf://org/name@", "hf://<org>/<name>"),
        ("hf://org/na me", "hf://<org>/<name>"),
        ("hf://../name", "hf://<org>/<name>"),
        ("pvc://Bad_Claim/x", "valid claim name"),
        ("pvc://claim/../other", "may not contain '..'"),
        ("file://relative", "absolute path"),
        ("file:///", "absolute path"),
        ("file:///models/../etc", "may not contain '..'"),
        ("", "scheme must be"),
    ],
)
def test_invalid_uris(uri: str, message: str) -> None:
    with pytest.raises(ModelURIError, match=message.replace("(", r"\(")):
        parse_model_uri(uri)
