"""API keys without the app: which principal each key stands for, episode keys that any replica
verifies from the admin key alone, constant-time comparison, and where a key is read from."""

from __future__ import annotations

import hmac
import uuid

import pytest

from proxy.auth import EPISODE_KEY_PREFIX, KeyRing, Principal, bearer

ADMIN_KEY = "admin-key-0123456789abcdef"
AGENT_KEYS = ["agent-key-0123456789abcdef", "agent-key-fedcba9876543210"]


@pytest.fixture
def ring() -> KeyRing:
    return KeyRing(ADMIN_KEY, AGENT_KEYS)


def test_admin_and_agent_keys_have_their_roles(ring: KeyRing) -> None:
    assert ring.identify(ADMIN_KEY) == Principal("admin")
    assert [ring.identify(k) for k in AGENT_KEYS] == [Principal("agent", None)] * 2  # scoped to no episode


@pytest.mark.parametrize(
    "key",
    [
        None,
        "",
        "nope",
        ADMIN_KEY[:-1],
        ADMIN_KEY + "x",
        ADMIN_KEY.upper(),
        " " + ADMIN_KEY,
        AGENT_KEYS[0][:-1],
        EPISODE_KEY_PREFIX,
    ],
)
def test_missing_or_wrong_keys_stand_for_nobody(ring: KeyRing, key: str | None) -> None:
    assert ring.identify(key) is None


def test_a_ring_without_agent_keys_admits_no_agent(ring: KeyRing) -> None:
    alone = KeyRing(ADMIN_KEY, [])
    assert alone.identify(AGENT_KEYS[0]) is None and alone.identify(ADMIN_KEY) == Principal("admin")


def test_an_episode_key_names_its_episode_and_nothing_else(ring: KeyRing) -> None:
    episode_id = str(uuid.uuid4())
    key = ring.episode_key(episode_id)
    assert key.startswith(f"{EPISODE_KEY_PREFIX}{episode_id}-")
    assert ring.identify(key) == Principal("episode", episode_id)
    other = str(uuid.uuid4())
    assert ring.episode_key(other) != key and ring.identify(ring.episode_key(other)) == Principal("episode", other)


def test_an_episode_key_is_verified_by_any_replica_sharing_the_admin_key(ring: KeyRing) -> None:
    """No database: another proxy replica (its own KeyRing, same settings) accepts the key; a proxy
    with another admin key does not."""
    episode_id = str(uuid.uuid4())
    key = ring.episode_key(episode_id)
    assert KeyRing(ADMIN_KEY, []).identify(key) == Principal("episode", episode_id)
    assert KeyRing("another-admin-key-0123456789", AGENT_KEYS).identify(key) is None


def test_a_forged_or_altered_episode_key_is_refused(ring: KeyRing) -> None:
    mine, theirs = str(uuid.uuid4()), str(uuid.uuid4())
    key = ring.episode_key(mine)
    signature = key.rsplit("-", 1)[1]
    forged = [
        f"{EPISODE_KEY_PREFIX}{theirs}-{signature}",  # my signature on another episode
        key[:-1] + ("A" if key[-1] != "A" else "B"),  # one character of the signature changed
        key[:-1],  # truncated
        key + "A",  # extended
        f"{EPISODE_KEY_PREFIX}{mine}-",  # no signature
        f"{EPISODE_KEY_PREFIX}{mine.upper()}-{signature}",  # the id spelled otherwise
        f"{EPISODE_KEY_PREFIX}{mine}-{ring.episode_key(theirs).rsplit('-', 1)[1]}",  # another episode's signature
    ]
    assert [ring.identify(k) for k in forged] == [None] * len(forged)


def test_an_episode_key_is_never_the_admin_or_an_agent_key(ring: KeyRing) -> None:
    episode_id = str(uuid.uuid4())
    key = ring.episode_key(episode_id)
    assert ADMIN_KEY not in key and all(agent not in key for agent in AGENT_KEYS)
    assert ring.identify(key) == Principal("episode", episode_id)


def test_every_key_is_compared_with_compare_digest(ring: KeyRing, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module promises constant-time checks: with ``hmac.compare_digest`` made to answer "no",
    no right key is recognised, so none is compared with ``==`` or ``in``."""
    compared: list[tuple[bytes, bytes]] = []

    def never_equal(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return False

    episode_key = ring.episode_key(str(uuid.uuid4()))
    monkeypatch.setattr(hmac, "compare_digest", never_equal)
    for key in (ADMIN_KEY, *AGENT_KEYS, episode_key):
        compared.clear()
        assert ring.identify(key) is None
        assert compared and all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in compared)


@pytest.mark.parametrize(
    ("authorization", "api_key", "expected"),
    [
        ("Bearer k1", None, "k1"),
        ("bearer k1", None, "k1"),  # the scheme is case-insensitive
        ("BEARER   k1  ", None, "k1"),  # surrounding whitespace is not part of the key
        ("Bearer k1", "k2", "k1"),  # Authorization wins over api-key
        ("Basic dXNlcjpwYXNz", "k2", "k2"),  # another scheme is no bearer key
        ("Bearer ", "k2", "k2"),
        ("Bearer", None, None),
        (None, "k2", "k2"),  # api-key / x-api-key (Azure-style and Anthropic SDKs)
        (None, "", None),
        (None, None, None),
        ("", None, None),
    ],
)
def test_bearer_reads_the_key_from_either_header(
    authorization: str | None, api_key: str | None, expected: str | None
) -> None:
    assert bearer(authorization, api_key) == expected
