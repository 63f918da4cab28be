"""Redaction detectors and the placeholder rule (proxy/redaction.py): engine-free, pure."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from proxy.redaction import (
    DEFAULT_KINDS,
    IPV4,
    KINDS,
    NAME,
    LiteralDetector,
    Placeholders,
    RedactionSettings,
    Redactor,
    luhn_valid,
    redact_json,
)

KEY = b"k" * 32
OPENAI = "sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z"
ANTHROPIC = "sk-ant-api03-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe_dcba-XYZ"
AWS = "AKIAIOSFODNN7EXAMPLE"
GITHUB = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
GITHUB_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuv"
SLACK = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
GOOGLE = "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
FW_KEY = "fw-ep-3f2b8c1e-9a4d-4e7b-8c2f-1a2b3c4d5e6f-" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345"
PEM = (
    "-----BEGIN RSA PRIVATE KEY-----\n"
    "MIIEowIBAAKCAQEA0Z3VS5JJcds3xfn/ygWyF8PbnGy0AHB7MhgHcTz6sE2I2yPB\n"
    "aFDrBz9vFqU4yzGv1QIDAQABAoIBAQC0x1v2bQZ3X1J4j6Z2sYH1b6b0X8e3Q==\n"
    "-----END RSA PRIVATE KEY-----"
)
CARD = "4111 1111 1111 1111"  # the Visa test number: Luhn-valid
EMAIL = "jane.doe@example.com"


@pytest.fixture
def redactor() -> Redactor:
    return Redactor()


@pytest.fixture
def state() -> Placeholders:
    return Placeholders(KEY)


def kinds_found(redactor: Redactor, text: str) -> list[tuple[str, str]]:
    return [(kind, text[s:e]) for s, e, kind in redactor.find(text)]


@pytest.mark.parametrize(
    ("kind", "value", "sentence"),
    [
        ("API_KEY", OPENAI, "my key is {} please use it"),
        ("API_KEY", "sk-" + "A" * 10 + "b" * 38, "OPENAI_API_KEY={}"),
        ("API_KEY", ANTHROPIC, 'export ANTHROPIC_API_KEY="{}"'),
        ("API_KEY", GOOGLE, "https://maps.googleapis.com/maps/api?key={}&q=1"),
        ("AWS_KEY", AWS, "aws_access_key_id = {}"),
        ("AWS_KEY", "ASIAY34FZKBOKMUTVV7A", "temporary id {}, expires soon"),
        ("GITHUB_TOKEN", GITHUB, "git remote set-url origin https://x:{}/o/r.git"),
        ("GITHUB_TOKEN", GITHUB_PAT, "token: {}"),
        ("SLACK_TOKEN", SLACK, "SLACK_BOT_TOKEN={}"),
        ("JWT", JWT, "the session cookie was {}; it expired"),
        ("FLYWHEEL_KEY", FW_KEY, "OPENAI_API_KEY={} python agent.py"),
        ("BEARER_TOKEN", "Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1Njc4OTA", "curl -H 'Authorization: Bearer {}' url"),
        ("EMAIL", EMAIL, "Write to {}, she answers fast."),
        ("EMAIL", "Bob+tag@mail.example.co.uk", "cc: <{}>"),
        ("PHONE", "+44 20 7946 0958", "Call me at {} tomorrow."),
        ("PHONE", "+1 (555) 123-4567", "Phone: {}."),
        ("PHONE", "+4915112345678", "WhatsApp {}"),
        ("PHONE", "(555) 123-4567", "office {} ext 2"),
        ("PHONE", "555-123-4567", "text {}!"),
        ("PHONE", "020 7946 0958", "London number {}"),
        ("PHONE", "1-800-555-0199", "toll free {}"),
        ("CARD", CARD, "charge card {} exp 12/27"),
        ("CARD", "5555-5555-5555-4444", "Mastercard {}."),
        ("CARD", "378282246310005", "amex {}"),
    ],
)
def test_detector_finds_planted_value(redactor: Redactor, kind: str, value: str, sentence: str) -> None:
    text = sentence.format(value)
    assert kinds_found(redactor, text) == [(kind, value)]


def test_pem_block_spanning_lines(redactor: Redactor, state: Placeholders) -> None:
    text = f"Here is the deploy key:\n{PEM}\nkeep it safe"
    out = redactor.redact(text, state)
    assert out.text == "Here is the deploy key:\n<PRIVATE_KEY_1>\nkeep it safe"
    assert text[out.spans[0].start : out.spans[0].end] == PEM
    # cut off before its END line: still redacted through its body
    cut = "key:\n" + PEM.rsplit("\n", 1)[0]
    assert redactor.redact(cut, Placeholders(KEY)).text == "key:\n<PRIVATE_KEY_1>"


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112 declined",  # Luhn-invalid 16 digits
        "id 4111111111111112",
        "The answer is 12345678.",  # math answer
        "x = 123456789012 and y = 98765432101",  # long bare integers
        "We meet on 2026-11-28 at 10:30.",
        "released 2026-11-28T10:30:00Z, build 20261128",
        "upgrade to v1.2.3.4 or 1.2.3",
        "commit 3f5a9c0e1d2b4a6f8e7d9c1b3a5f7e9d2c4b6a8f fixed it",
        "commit 1234567890123456789012345678901234567890",
        "episode 123e4567-e89b-12d3-a456-426614174000 done",
        "uuid 12345678-1234-1234-1234-123456789012",
        "population 1 000 000 and 12 345 678 901",
        "total: 4,111,111,111 units",
        "sum = 5555555555555555",  # one repeated digit, Luhn-valid
        "task-forcebearerless",
        "the Bearer scheme is described in RFC 6750",
        "skip sk-short and AKIA123",
        "math: 3 + 4 = 7, 100 - 55 = 45",
        "serve on 127.0.0.1:8000 and 0.0.0.0",
    ],
)
def test_look_alikes_left_alone(redactor: Redactor, text: str) -> None:
    assert kinds_found(redactor, text) == []


def test_ipv4_off_by_default_and_on_when_asked() -> None:
    assert IPV4 not in DEFAULT_KINDS and NAME not in DEFAULT_KINDS
    text = "the client at 203.0.113.7 called"
    assert kinds_found(Redactor(), text) == []
    on = Redactor(RedactionSettings(kinds=DEFAULT_KINDS | {IPV4}))
    assert kinds_found(on, text) == [(IPV4, "203.0.113.7")]
    # A bare 1.2.3.4 is an address (why IPV4 is off); a v-prefixed version, a longer dotted run,
    # an octet over 255 and loopback are not.
    assert kinds_found(on, "build 1.2.3.4") == [(IPV4, "1.2.3.4")]
    for text in ("v1.2.3.4", "1.2.3.4.5", "256.1.1.1", "127.0.0.1", "10.0.0.1.2"):
        assert kinds_found(on, text) == [], text


def test_luhn() -> None:
    assert luhn_valid("4111111111111111") and luhn_valid("79927398713")
    assert not luhn_valid("4111111111111112") and not luhn_valid("79927398710")


def test_same_value_same_placeholder_and_numbering(redactor: Redactor, state: Placeholders) -> None:
    text = f"From {EMAIL} to bob@example.org, reply to {EMAIL.upper()}; key {OPENAI}"
    out = redactor.redact(text, state)
    assert out.text == "From <EMAIL_1> to <EMAIL_2>, reply to <EMAIL_1>; key <API_KEY_1>"
    assert out.counts == {"EMAIL": 3, "API_KEY": 1}
    assert [text[s.start : s.end] for s in out.spans] == [EMAIL, "bob@example.org", EMAIL.upper(), OPENAI]
    assert [s.placeholder for s in out.spans] == ["<EMAIL_1>", "<EMAIL_2>", "<EMAIL_1>", "<API_KEY_1>"]
    assert state.counts() == {"EMAIL": 2, "API_KEY": 1}


def test_consistent_across_calls_and_dict_round_trip(redactor: Redactor, state: Placeholders) -> None:
    first = redactor.redact(f"mail {EMAIL} or call +44 20 7946 0958", state)
    assert first.text == "mail <EMAIL_1> or call <PHONE_1>"
    second = redactor.redact(f"again +44 20 7946 0958, and {EMAIL}, new: x@y.io", state)
    assert second.text == "again <PHONE_1>, and <EMAIL_1>, new: <EMAIL_2>"

    stored = json.dumps(state.to_dict())
    for planted in (EMAIL, EMAIL.lower(), "x@y.io", "+44 20 7946 0958", "7946", "example.com"):
        assert planted not in stored
    reloaded = Placeholders.from_dict(json.loads(stored), KEY)
    third = redactor.redact(f"{EMAIL} / x@y.io / z@y.io / +1 (555) 123-4567 / +44 20 7946 0958", reloaded)
    assert third.text == "<EMAIL_1> / <EMAIL_2> / <EMAIL_3> / <PHONE_2> / <PHONE_1>"

    with pytest.raises(ValueError, match="another HMAC key"):
        Placeholders.from_dict(json.loads(stored), b"x" * 32)
    with pytest.raises(ValueError):
        Placeholders.from_dict({**json.loads(stored), "placeholders": {"zz": "<EMAIL_1>"}}, KEY)
    with pytest.raises(ValueError):
        Placeholders(b"short")


def test_spans_point_at_original_text(redactor: Redactor, state: Placeholders) -> None:
    text = f"a {AWS} b\n{PEM}\nc {CARD} d jane@x.org e"
    out = redactor.redact(text, state)
    assert [(text[s.start : s.end], s.kind) for s in out.spans] == [
        (AWS, "AWS_KEY"),
        (PEM, "PRIVATE_KEY"),
        (CARD, "CARD"),
        ("jane@x.org", "EMAIL"),
    ]
    # rebuild the redacted text from the spans
    rebuilt, at = [], 0
    for s in out.spans:
        rebuilt += [text[at : s.start], s.placeholder]
        at = s.end
    assert "".join(rebuilt) + text[at:] == out.text


def test_overlap_longest_then_first_detector(redactor: Redactor, state: Placeholders) -> None:
    # The Bearer token is an OpenAI key: same span, the key detector is listed first.
    out = redactor.redact(f"Authorization: Bearer {OPENAI}", state)
    assert out.text == "Authorization: Bearer <API_KEY_1>"
    # An e-mail whose local part looks like a phone: the longer e-mail wins.
    assert redactor.redact("555-123-4567@example.com", state).text == "<EMAIL_1>"
    # A token in a URL's user part reads as an e-mail address, the longer match: still redacted.
    assert redactor.redact(f"https://{GITHUB}@github.com/o/r.git", state).text == "https://<EMAIL_2>/o/r.git"


def test_idempotent(redactor: Redactor, state: Placeholders) -> None:
    text = (
        f"Hi, I'm at {EMAIL} or +1 (555) 123-4567; card {CARD}, key={OPENAI}, "
        f"gh {GITHUB}, jwt {JWT}\n{PEM}\nBearer Zm9vYmFyYmF6cXV4cXV1eDEyMzQ1Njc4OTA end. "
        f"{EMAIL}555-123-4567 <EMAIL_1>x@y.io"
    )
    once = redactor.redact(text, state)
    twice = redactor.redact(once.text, state)
    assert twice.text == once.text and twice.spans == () and twice.counts == {}
    assert once.text.startswith("Hi, I'm at <EMAIL_1> or <PHONE_1>; card <CARD_1>, key=<API_KEY_1>")
    # Glued to a phone, the address is ambiguous text, found by neither pass; glued to a placeholder's
    # ">", a value is never found (the price of idempotence: it could have been glued to a redacted one).
    assert once.text.endswith(f"{EMAIL}555-123-4567 <EMAIL_1>x@y.io")


def test_placeholder_text_never_matched(redactor: Redactor, state: Placeholders) -> None:
    assert redactor.redact("already <EMAIL_7> and <API_KEY_1>", state).spans == ()


def test_disabled_kinds_left_alone(state: Placeholders) -> None:
    only_email = Redactor(RedactionSettings(kinds=frozenset({"EMAIL"})))
    text = f"{EMAIL} {OPENAI} {CARD} +44 20 7946 0958"
    out = only_email.redact(text, state)
    assert out.text == f"<EMAIL_1> {OPENAI} {CARD} +44 20 7946 0958"
    assert out.counts == {"EMAIL": 1}
    assert Redactor(RedactionSettings(kinds=frozenset())).redact(text, state).text == text


def test_settings_and_name_hook() -> None:
    with pytest.raises(ValueError):
        RedactionSettings(kinds=frozenset({"email"}))
    with pytest.raises(ValueError, match="NAME"):
        Redactor(RedactionSettings(kinds=DEFAULT_KINDS | {NAME}))
    assert DEFAULT_KINDS | {IPV4} == KINDS

    class Names:
        kind = NAME

        def find(self, text: str) -> Iterator[tuple[int, int]]:
            at = text.find("Ada Lovelace")
            if at >= 0:
                yield at, at + len("Ada Lovelace")

    admin = "q7Vw2rX9" * 5
    redactor = Redactor(
        RedactionSettings(kinds=DEFAULT_KINDS | {NAME, "ADMIN_KEY"}),
        extra=[Names(), LiteralDetector("ADMIN_KEY", frozenset({admin}))],
    )
    out = redactor.redact(f"Ada Lovelace used {admin} at {EMAIL}", Placeholders(KEY))
    assert out.text == "<NAME_1> used <ADMIN_KEY_1> at <EMAIL_1>"


def test_redact_json_chat_body(redactor: Redactor, state: Placeholders) -> None:
    body = {
        "model": "policy",
        "messages": [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": f"Email {EMAIL} my card {CARD}."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Also cc bob@example.org and {EMAIL}"},
                    {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_123e4567-e89b-12d3-a456-426614174000",
                        "type": "function",
                        "function": {
                            "name": "send_email",
                            "arguments": json.dumps({"to": EMAIL, "api_key": OPENAI, "n": 12345678}),
                        },
                    }
                ],
            },
        ],
        "temperature": 0.7,
        "max_tokens": 12345678,
        EMAIL: "keys are untouched",
    }
    original = json.dumps(body)
    out, counts = redact_json(body, redactor, state)
    assert json.dumps(body) == original  # the input is not changed
    assert counts == {"EMAIL": 4, "CARD": 1, "API_KEY": 1}
    msgs = out["messages"]
    assert msgs[1]["content"] == "Email <EMAIL_1> my card <CARD_1>."
    assert msgs[2]["content"][0]["text"] == "Also cc <EMAIL_2> and <EMAIL_1>"
    assert msgs[2]["content"][1] == body["messages"][2]["content"][1]
    call = msgs[3]["tool_calls"][0]
    assert call["id"] == "call_123e4567-e89b-12d3-a456-426614174000"
    assert json.loads(call["function"]["arguments"]) == {"to": "<EMAIL_1>", "api_key": "<API_KEY_1>", "n": 12345678}
    assert out["max_tokens"] == 12345678 and out["temperature"] == 0.7 and msgs[3]["content"] is None
    assert out[EMAIL] == "keys are untouched"


def test_long_tokens_scan_in_linear_time(redactor: Redactor, state: Placeholders) -> None:
    blob = ("QUJDRE" * 20_000) + " " + ("1234567890" * 10_000) + " " + ("a.b-" * 20_000) + " x@y.io"
    started = time.perf_counter()
    out = redactor.redact(blob, state)
    assert time.perf_counter() - started < 0.5
    assert out.counts == {"EMAIL": 1}
