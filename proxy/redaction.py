"""Redaction of secrets and personal data in recorded text: the detectors and the placeholder rule (issue 50).

Recorded traffic holds what users typed: e-mail addresses, phone numbers, card numbers, API keys
pasted into a prompt. What the proxy stores and trains is to be redacted (the agent still receives
the engine's real answer): each match is replaced with a typed placeholder ``<KIND_N>``, and the
same value is the same placeholder everywhere in one episode, so a trajectory that mentions an
address three times still reads as one address. This module is that rule only, pure (no I/O, no
clock): ``Redactor.redact`` takes a text and the episode's ``Placeholders`` and answers the new
text, the spans it replaced in the ORIGINAL text's coordinates (the proxy marks those tokens
untrained) and a count per kind (the proxy surfaces them as metrics: nothing is redacted silently).

The detectors (``DETECTORS``; each one's ``kind`` is its placeholder's type):

    API_KEY        OpenAI ``sk-``/``sk-proj-``/``sk-svcacct-``/``sk-admin-`` + 20 or more key characters;
                   Anthropic ``sk-ant-`` (e.g. ``sk-ant-api03-``); Google ``AIza`` + exactly 35
                   (prefixes as each vendor issues and documents them; GitHub secret scanning lists
                   the same shapes)
    AWS_KEY        access key ids ``AKIA`` (long-term) / ``ASIA`` (temporary) + 16 upper-case letters
                   or digits (AWS IAM User Guide, "Unique identifiers": the id prefixes)
    GITHUB_TOKEN   ``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_`` + 36 or more, ``github_pat_`` + 22 or more
                   (GitHub blog, "Behind GitHub's new authentication token formats", 2021)
    SLACK_TOKEN    ``xoxa-``/``xoxb-``/``xoxp-``/``xoxr-``/``xoxs-`` + 10 or more (Slack API, "Token types")
    JWT            three base64url parts, the first starting ``eyJ`` (base64url of ``{"``: a JOSE header
                   is a JSON object, RFC 7519 section 3 / RFC 7515)
    PRIVATE_KEY    ``-----BEGIN ... PRIVATE KEY-----`` through its matching ``-----END ...-----`` line,
                   across lines (RFC 7468 encapsulation); a block cut off before its END line is
                   redacted through the end of its base64 body
    BEARER_TOKEN   ``Bearer <token>`` in text (RFC 6750 section 2.1's b64token, 20 or more characters):
                   the token only, ``Bearer`` stays
    FLYWHEEL_KEY   Flywheel's own episode keys, ``fw-ep-<36-character episode id>-<32 base64url>`` (the
                   shape ``proxy/auth.py`` mints: ``EPISODE_KEY_PREFIX``, a UUID, 24 HMAC bytes in
                   url-safe base64). Admin keys (``secrets.token_urlsafe(32)``, or any string of 16 or
                   more characters from settings or the key file) and agent keys (any string) have no
                   shape: the proxy knows them, so it plugs in a ``LiteralDetector`` with their values.
    EMAIL          ``local@domain.tld`` (the common dot-atom form of RFC 5322, no quoted local parts);
                   one value whatever its case (``Placeholders`` folds it)
    PHONE          international ``+`` forms, 8 to 15 digits (ITU-T E.164's maximum), with or without
                   separators (``+44 20 7946 0958``, ``+1 (555) 123-4567``, ``+4915112345678``); national
                   forms only with separators between groups, 10 or 11 digits (``(555) 123-4567``,
                   ``555-123-4567``, ``020 7946 0958``, ``1-800-555-0199``)
    CARD           13 to 19 digits, optionally grouped by single spaces or dashes, first digit 2 to 6
                   (the banking and card-network Major Industry Identifiers of ISO/IEC 7812-1), and
                   Luhn-valid (ISO/IEC 7812-1 Annex B check digit)
    IPV4           dotted quads with every octet 0-255, neither loopback nor 0.0.0.0; OFF by default
                   (``DEFAULT_KINDS``): a four-part version ``1.2.3.4`` is the same text as an address,
                   and agent traffic is full of service addresses that are nobody's personal data
    NAME           no detector: no regular expression finds names reliably. A name detector (a model, a
                   gazetteer) implements ``Detector`` and is passed as ``Redactor(..., extra=[...])``;
                   enabling ``NAME`` without one is an error, not a silent no-op.

What is deliberately NOT matched, because agent traffic is full of it: UUIDs and git SHAs (every
detector refuses to start or end inside a run of word characters, ``-`` or ``.``), dates
(``2026-11-28``: no phone form has a 2-digit middle group), versions (``1.2.3``; ``v1.2.3.4``),
plain integers and math answers (``12345678``, ``1 000 000``: a national phone needs separators and
10 or 11 digits, an international one a ``+``), Luhn-invalid or 1/7/8/9/0-led digit runs as cards,
and numbers with thousands separators whose groups run on (``12 345 678 901``).

The placeholder rule. Overlapping matches: the longest wins, then the earliest, then the detector
listed first (so ``Bearer sk-...`` is an ``API_KEY``, not a ``BEARER_TOKEN``). Text already shaped
like a placeholder (``<KIND_N>``) is never matched, and no match starts right after a ``>`` or
ends right before a ``<`` (a value glued to a placeholder is left: it could have been glued to the
value the placeholder replaced), so redacting twice with the same state changes nothing. ``Placeholders`` numbers
each kind's distinct values in first-seen order (``<EMAIL_1>``, ``<EMAIL_2>``); its dict form
(``to_dict``/``from_dict``) holds, for each value, an HMAC-SHA256 of it under a key the caller
passes (RFC 2104), never the value: it can be stored with the episode and reloaded for the next
call, and without the key nobody can test a guess (a phone number) against it. The dict also holds
a check value of the key, so reloading under another key fails loudly instead of renumbering.

``redact_json`` applies a redactor to every string inside a JSON-like value (a chat request body:
message contents, content-part lists, tool-call ``arguments``, which are a JSON document inside a
string and are redacted as that string); keys are left alone. A value escaped inside such a
string (``\\u0040`` for ``@``) is not seen.

Detectors scan linearly: each pattern begins with a look-behind that refuses to start inside a run
of its own characters, so a long token without a match costs one pass, not one pass per offset.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, field_validator

API_KEY = "API_KEY"
AWS_KEY = "AWS_KEY"
GITHUB_TOKEN = "GITHUB_TOKEN"
SLACK_TOKEN = "SLACK_TOKEN"
JWT = "JWT"
PRIVATE_KEY = "PRIVATE_KEY"
BEARER_TOKEN = "BEARER_TOKEN"
FLYWHEEL_KEY = "FLYWHEEL_KEY"
EMAIL = "EMAIL"
PHONE = "PHONE"
CARD = "CARD"
IPV4 = "IPV4"
NAME = "NAME"
"""The kind a plugged-in name detector reports; no detector for it ships here."""

DEFAULT_KINDS: frozenset[str] = frozenset(
    {API_KEY, AWS_KEY, GITHUB_TOKEN, SLACK_TOKEN, JWT, PRIVATE_KEY, BEARER_TOKEN, FLYWHEEL_KEY, EMAIL, PHONE, CARD}
)
"""Every shipped detector's kind except ``IPV4`` (see the module docstring); ``NAME`` has none."""

KIND_RE = re.compile(r"[A-Z][A-Z0-9_]*")
PLACEHOLDER_RE = re.compile(r"<([A-Z][A-Z0-9_]*)_([1-9][0-9]*)>")
"""A placeholder in redacted text: never matched again."""
STATE_VERSION = 1


class Span(NamedTuple):
    """One replaced stretch: ``text[start:end]`` of the ORIGINAL text became ``placeholder``."""

    start: int
    end: int
    kind: str
    placeholder: str


class Redaction(NamedTuple):
    text: str
    spans: tuple[Span, ...]
    """In the original text's coordinates, in order, never overlapping."""
    counts: dict[str, int]
    """Replacements per kind (occurrences, not distinct values); kinds with none are absent."""


class Detector(Protocol):
    """Finds one kind of value in a text: the hook for detectors this module does not ship (names)."""

    @property
    def kind(self) -> str: ...

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        """``(start, end)`` of each match in ``text``; they may overlap other detectors' matches."""
        ...


@dataclass(frozen=True, slots=True)
class PatternDetector:
    """A compiled pattern, the group that is the value (``Bearer`` keeps its scheme word), a validator."""

    kind: str
    name: str
    pattern: re.Pattern[str]
    group: int = 0
    validator: Callable[[str], bool] | None = None

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        for m in self.pattern.finditer(text):
            value = m.group(self.group)
            if value and (self.validator is None or self.validator(value)):
                yield m.start(self.group), m.end(self.group)


@dataclass(frozen=True, slots=True)
class LiteralDetector:
    """Exact known values (the proxy's admin and agent keys, which have no shape), longest first."""

    kind: str
    values: frozenset[str]
    pattern: re.Pattern[str] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        values = sorted((v for v in self.values if v), key=lambda v: (-len(v), v))
        compiled = re.compile("|".join(re.escape(v) for v in values)) if values else None
        object.__setattr__(self, "pattern", compiled)

    def find(self, text: str) -> Iterator[tuple[int, int]]:
        if self.pattern is not None:
            for m in self.pattern.finditer(text):
                yield m.start(), m.end()


def luhn_valid(digits: str) -> bool:
    """The Luhn check digit (ISO/IEC 7812-1 Annex B): from the right, double every second digit."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _digits(value: str) -> str:
    return "".join(ch for ch in value if ch.isdigit())


def _card(value: str) -> bool:
    digits = _digits(value)
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and len(set(digits)) > 1 and luhn_valid(digits)


def _international_phone(value: str) -> bool:
    return 8 <= len(_digits(value)) <= 15


def _national_phone(value: str) -> bool:
    return 10 <= len(_digits(value)) <= 11


def _ipv4(value: str) -> bool:
    address = ipaddress.IPv4Address(value)
    return not (address.is_loopback or address.is_unspecified)


# A token neither starts right after nor ends right before one of its own characters or a dot,
# so ids, hashes and URLs are not cut into pieces; nor right after a placeholder's ``>`` or right
# before its ``<``, so a value that touched a redacted one is not found only on a second pass.
_B = r"(?<![A-Za-z0-9_\-.>])"  # before a key-like token
_E = r"(?![A-Za-z0-9_\-<])"  # after a key-like token
_KEYCH = r"[A-Za-z0-9_\-]"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_BEFORE_NUMBER = r"(?<![A-Za-z0-9_\-+.>])(?<![0-9][ .\-])"
_AFTER_NUMBER = r"(?![A-Za-z0-9_<])(?![ .\-]?[0-9])"


def _re(pattern: str, flags: int = 0) -> re.Pattern[str]:
    return re.compile(pattern, flags | re.ASCII)


DETECTORS: tuple[PatternDetector, ...] = (
    PatternDetector(
        PRIVATE_KEY,
        "pem-private-key",
        _re(
            r"-----BEGIN ((?:[A-Z0-9]+ )*PRIVATE KEY)-----(?:.*?-----END \1-----|[A-Za-z0-9+/=\s\\:,\-]*)",
            re.DOTALL,
        ),
    ),
    PatternDetector(FLYWHEEL_KEY, "flywheel-episode-key", _re(_B + r"fw-ep-[0-9A-Fa-f\-]{36}-[A-Za-z0-9_\-]{32}" + _E)),
    PatternDetector(API_KEY, "anthropic", _re(_B + r"sk-ant-" + _KEYCH + r"{20,}" + _E)),
    PatternDetector(API_KEY, "openai", _re(_B + r"sk-(?!ant-)(?:proj-|svcacct-|admin-)?" + _KEYCH + r"{20,}" + _E)),
    PatternDetector(API_KEY, "google", _re(_B + r"AIza" + _KEYCH + r"{35}" + _E)),
    PatternDetector(AWS_KEY, "aws-access-key-id", _re(_B + r"(?:AKIA|ASIA)[A-Z0-9]{16}" + _E)),
    PatternDetector(
        GITHUB_TOKEN, "github", _re(_B + r"(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})" + _E)
    ),
    PatternDetector(SLACK_TOKEN, "slack", _re(_B + r"xox[abprs]-[A-Za-z0-9\-]{10,}" + _E)),
    PatternDetector(JWT, "jwt", _re(_B + r"eyJ" + _KEYCH + r"{8,}\." + _KEYCH + r"{8,}\." + _KEYCH + r"{8,}" + _E)),
    PatternDetector(
        BEARER_TOKEN,
        "bearer",
        _re(r"(?<![A-Za-z0-9_\-])[Bb]earer[ \t]+([A-Za-z0-9._~+/\-]{20,}=*)(?![A-Za-z0-9._~+/=\-<])"),
        group=1,
    ),
    PatternDetector(
        EMAIL,
        "email",
        _re(
            r"(?<![A-Za-z0-9._%+\->])[A-Za-z0-9_%+\-]+(?:\.[A-Za-z0-9_%+\-]+)*"
            r"@[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9\-]*[A-Za-z0-9])?)*"
            r"\.[A-Za-z]{2,24}(?![A-Za-z0-9_\-<]|\.[A-Za-z0-9])"
        ),
    ),
    PatternDetector(
        PHONE,
        "phone-international",
        _re(
            _BEFORE_NUMBER
            + r"\+(?:[0-9]{7,15}|[0-9]{1,4}(?:[ .\-]?\([0-9]{1,4}\)|[ .\-][0-9]{1,5}){1,6})"
            + _AFTER_NUMBER
        ),
        validator=_international_phone,
    ),
    PatternDetector(
        PHONE,
        "phone-national",
        _re(
            _BEFORE_NUMBER
            + r"(?:1[ .\-])?(?:\([0-9]{2,4}\)[ .\-]?|[0-9]{2,4}[ .\-])[0-9]{3,4}[ .\-][0-9]{3,4}"
            + _AFTER_NUMBER
        ),
        validator=_national_phone,
    ),
    PatternDetector(
        CARD,
        "payment-card",
        _re(r"(?<![A-Za-z0-9_\-+.>])(?<![0-9][ .\-])(?:[0-9][ \-]?){12,18}[0-9]" + _AFTER_NUMBER),
        validator=_card,
    ),
    PatternDetector(
        IPV4,
        "ipv4",
        _re(r"(?<![A-Za-z0-9_\-.>])" + _OCTET + r"(?:\." + _OCTET + r"){3}(?![A-Za-z0-9_\-<]|\.[0-9])"),
        validator=_ipv4,
    ),
)
KINDS: frozenset[str] = frozenset(d.kind for d in DETECTORS)
"""The kinds the shipped detectors report."""


class RedactionSettings(BaseModel):
    """Which kinds are redacted (frozen: a redactor's settings never change under it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kinds: frozenset[str] = DEFAULT_KINDS

    @field_validator("kinds")
    @classmethod
    def _kind_names(cls, kinds: frozenset[str]) -> frozenset[str]:
        bad = sorted(k for k in kinds if not KIND_RE.fullmatch(k))
        if bad:
            raise ValueError(f"kinds must be upper-case names like EMAIL, got {bad}")
        return kinds


def _normalize(kind: str, value: str) -> str:
    return value.casefold() if kind == EMAIL else value


class Placeholders:
    """One episode's placeholders: each distinct (kind, value) to ``<KIND_N>``, numbered per kind in
    first-seen order. Holds keyed hashes of the values, never the values."""

    __slots__ = ("_key", "_by_digest", "_next")

    def __init__(self, key: bytes) -> None:
        """``key``: the HMAC key (a deployment secret, 16 bytes or more); the same one must reload the state."""
        if len(key) < 16:
            raise ValueError("the placeholder HMAC key needs 16 bytes or more")
        self._key = key
        self._by_digest: dict[str, str] = {}
        self._next: dict[str, int] = {}

    def _digest(self, kind: str, value: str) -> str:
        message = f"{kind}\0{_normalize(kind, value)}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def _check(self) -> str:
        return hmac.new(self._key, b"flywheel-redaction-key-check", hashlib.sha256).hexdigest()[:16]

    def placeholder(self, kind: str, value: str) -> str:
        """The placeholder of ``value`` as a ``kind``, numbering it on first sight."""
        digest = self._digest(kind, value)
        found = self._by_digest.get(digest)
        if found is None:
            n = self._next.get(kind, 0) + 1
            self._next[kind] = n
            found = self._by_digest[digest] = f"<{kind}_{n}>"
        return found

    def __len__(self) -> int:
        return len(self._by_digest)

    def counts(self) -> dict[str, int]:
        """Distinct values per kind so far."""
        return dict(self._next)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form: HMAC-SHA256 hex digests to placeholders, and a check of the key."""
        return {
            "version": STATE_VERSION,
            "algorithm": "hmac-sha256",
            "key_check": self._check(),
            "placeholders": dict(self._by_digest),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], key: bytes) -> Placeholders:
        """The state ``to_dict`` wrote, under the same ``key``; a wrong key or a malformed dict raises ValueError."""
        state = cls(key)
        if data.get("version") != STATE_VERSION or data.get("algorithm") != "hmac-sha256":
            raise ValueError(f"unknown placeholder state version {data.get('version')!r}/{data.get('algorithm')!r}")
        if not hmac.compare_digest(str(data.get("key_check", "")), state._check()):
            raise ValueError("the placeholder state was written under another HMAC key")
        entries = data.get("placeholders")
        if not isinstance(entries, dict):
            raise ValueError("placeholder state has no 'placeholders' mapping")
        for digest, placeholder in entries.items():
            m = PLACEHOLDER_RE.fullmatch(placeholder) if isinstance(placeholder, str) else None
            if m is None or not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"malformed placeholder entry {digest!r}: {placeholder!r}")
            state._by_digest[digest] = placeholder
            kind, n = m.group(1), int(m.group(2))
            state._next[kind] = max(state._next.get(kind, 0), n)
        return state


class Redactor:
    """The enabled detectors and the placeholder rule; stateless itself (the state is per episode)."""

    __slots__ = ("settings", "detectors")

    def __init__(
        self,
        settings: RedactionSettings | None = None,
        *,
        detectors: Sequence[Detector] = DETECTORS,
        extra: Sequence[Detector] = (),
    ) -> None:
        """``extra`` detectors (a name detector, a ``LiteralDetector`` of known keys) rank after ``detectors``
        on ties. Every enabled kind needs a detector: one without raises ValueError."""
        self.settings = settings or RedactionSettings()
        available = [*detectors, *extra]
        missing = sorted(self.settings.kinds - {d.kind for d in available})
        if missing:
            raise ValueError(f"no detector for enabled kinds {missing} (NAME needs one passed in extra=)")
        self.detectors: tuple[Detector, ...] = tuple(d for d in available if d.kind in self.settings.kinds)

    def find(self, text: str) -> list[tuple[int, int, str]]:
        """The ``(start, end, kind)`` that win: longest, then earliest, then first detector; none inside or
        overlapping a placeholder; in order, never overlapping."""
        protected = [(m.start(), m.end()) for m in PLACEHOLDER_RE.finditer(text)]
        candidates: list[tuple[int, int, int, str]] = []
        for rank, detector in enumerate(self.detectors):
            for start, end in detector.find(text):
                if end > start and not any(start < p_end and p_start < end for p_start, p_end in protected):
                    candidates.append((start, end, rank, detector.kind))
        candidates.sort(key=lambda c: (c[0] - c[1], c[0], c[2]))
        taken: list[tuple[int, int, str]] = []
        for start, end, _, kind in candidates:
            if not any(start < t_end and t_start < end for t_start, t_end, _ in taken):
                taken.append((start, end, kind))
        taken.sort()
        return taken

    def redact(self, text: str, state: Placeholders) -> Redaction:
        """``text`` with every enabled match replaced by its episode placeholder."""
        parts: list[str] = []
        spans: list[Span] = []
        counts: dict[str, int] = {}
        at = 0
        for start, end, kind in self.find(text):
            placeholder = state.placeholder(kind, text[start:end])
            parts += (text[at:start], placeholder)
            spans.append(Span(start, end, kind, placeholder))
            counts[kind] = counts.get(kind, 0) + 1
            at = end
        if not spans:
            return Redaction(text, (), {})
        parts.append(text[at:])
        return Redaction("".join(parts), tuple(spans), counts)


def _add(total: dict[str, int], counts: Mapping[str, int]) -> None:
    for kind, n in counts.items():
        total[kind] = total.get(kind, 0) + n


def redact_json(value: Any, redactor: Redactor, state: Placeholders) -> tuple[Any, dict[str, int]]:
    """Every string inside a JSON-like ``value`` (dicts, lists, tuples) redacted, keys untouched; a new value
    (the input is not changed) and the replacements per kind."""
    counts: dict[str, int] = {}

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            result = redactor.redact(item, state)
            _add(counts, result.counts)
            return result.text
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [walk(v) for v in item]
        return item

    return walk(value), counts


def redact_all(texts: Iterable[str], redactor: Redactor, state: Placeholders) -> tuple[list[str], dict[str, int]]:
    """Several texts of one episode in order (one state, so one value is one placeholder across them)."""
    out: list[str] = []
    counts: dict[str, int] = {}
    for text in texts:
        result = redactor.redact(text, state)
        out.append(result.text)
        _add(counts, result.counts)
    return out, counts
