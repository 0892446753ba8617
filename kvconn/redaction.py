"""Secrets never reach an error message, a repr, a log line or CLI output.

Backend options carry credentials in two shapes: a field whose name says so
(``password``, ``token``…) and the user-info part of a URL
(``redis://user:secret@host``). Everything that prints options or a URL goes through
these two functions, so a new option or backend is covered without its own code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

#: Option names whose values are secrets (matched case-insensitively, anywhere in the name).
_SECRET_NAME = re.compile(r"pass(word|wd)?|secret|token|credential|api_?key|auth", re.IGNORECASE)
#: ``scheme://user:password@`` — the password part, up to the last ``@`` before the host.
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/?#@\s]*:)[^\s/?#]*@")


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it masked (``redis://u:***@host``).

    Works on any text, so an exception message that quotes a URL can be cleaned too.
    """
    return _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", text)


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact_value(name: str, value: Any) -> Any:
    """One option's value, fit to show: masked when its name says secret; URLs cleaned."""
    if value is None:
        return None
    if is_secret_name(name):
        return MASK
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, Mapping):
        return redact_options(value)
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(name, v) for v in value)
    return value


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of backend options fit to show (errors, reprs, logs, ``--json`` output)."""
    return {str(k): redact_value(str(k), v) for k, v in options.items()}
