"""Names the settings and the bus share: the pipeline roles, and which strings may stand in a NATS subject (an
id is one token, a reply subject one can publish to).

Worker, gateway and request ids and the namespace each become one token of the subjects ``bus/subjects.py`` spells,
so the settings refuse a bad one when they are read (``runtime/settings.py``) and the bus when it builds or answers
a subject. Here, below both, so that the settings need not import the bus.
"""

from __future__ import annotations

import re

#: The pipeline roles, as in ``tandem serve --pipeline-role`` (DESIGN §2).
ROLE_PREFILL_AND_DECODE = "prefill_and_decode"
ROLE_PREFILL_ONLY = "prefill_only"
ROLE_DECODE_ONLY = "decode_only"
ROLES = (ROLE_PREFILL_AND_DECODE, ROLE_PREFILL_ONLY, ROLE_DECODE_ONLY)

_BAD_IN_TOKEN = re.compile(r"[.*>\s]")


def check_token(value: str, what: str = "token") -> str:
    """Refuse an id that is not a single subject token (worker, gateway and request ids).

    Ids are not silently rewritten: a mangled request id would never match its reply.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if _BAD_IN_TOKEN.search(value):
        raise ValueError(
            f"{what} {value!r} is not a subject token: it must not contain '.', '*', '>' or whitespace"
        )
    return value


def check_subject(value: str, what: str = "subject") -> str:
    """Refuse a subject nobody can publish to (empty tokens, wildcards, whitespace).

    Why: a reply subject comes from the sender; publishing to a bad one raises inside the
    receiving worker, which must answer or drop the message rather than fail later.
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    for token in value.split("."):
        if not token or token in ("*", ">") or _BAD_IN_TOKEN.search(token):
            raise ValueError(f"{what} {value!r} is not a subject one can publish to")
    return value
