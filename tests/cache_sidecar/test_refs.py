"""Model references and the enums that mirror the wire contract."""

from __future__ import annotations

import pytest

from cache_sidecar.errors import ErrorCode, InvalidReference
from cache_sidecar.progress import State
from cache_sidecar.refs import ModelRef
from protos.weightcache.v1 import cache_pb2

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_parse_commit_and_branch() -> None:
    ref = ModelRef.parse(f"org/name@{COMMIT}")
    assert (ref.repo, ref.revision, ref.pinned) == ("org/name", COMMIT, True)
    branch = ModelRef.parse("org/name@release/v1", allow_branch=True)
    assert not branch.pinned and branch.allow_branch and str(branch) == "org/name@release/v1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("org/name", "a revision is required"),
        ("org/name@", "a revision is required"),
        ("name@" + COMMIT, "expected 'org/name'"),
        ("../x@" + COMMIT, "invalid repository"),
        ("org/a/b@" + COMMIT, "invalid repository"),
        ("org/name@a..b", "invalid revision"),
        ("org/name@-x", "invalid revision"),
        ("org/name@has space", "invalid revision"),
    ],
)
def test_invalid_references(text: str, message: str) -> None:
    with pytest.raises(InvalidReference, match=message):
        ModelRef.parse(text)


def test_uppercase_hex_is_not_a_commit() -> None:
    assert not ModelRef("org/n", COMMIT.upper(), allow_branch=True).pinned


def test_enums_match_the_proto() -> None:
    assert {e.name: e.value for e in ErrorCode} == dict(cache_pb2.ErrorCode.items())
    assert {s.name: s.value for s in State} == dict(cache_pb2.State.items())
