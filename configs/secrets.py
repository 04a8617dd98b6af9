"""Secrets in configurations: API keys and the KV server's token, named by where they are read from.

A config file names a secret, never holds it: ``{"env": "MLAPOOL_API_KEY"}`` (an environment variable
of the process that uses it: on Kubernetes one filled from a Secret) or ``{"file": "/run/secrets/key"}``
(a mounted file; its trailing newline is dropped). A plain string is the secret itself, for code and
tests that make configs in memory. A :class:`Secret` prints as where it comes from, so a config that
is logged or shown says nothing of the value, and it is read (:meth:`Secret.reveal`) only by the process
that uses it, where that environment or file is.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Secret:
    env: str | None = None
    file: str | None = None
    value: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = [name for name in ("env", "file", "value") if getattr(self, name) is not None]
        if len(given) != 1 or not all(isinstance(getattr(self, name), str) and getattr(self, name) for name in given):
            raise ValueError(f"a secret is one non-empty env, file or value, got {given or 'none'}")

    @classmethod
    def of(cls, raw: Any, what: str) -> Secret:
        """A secret from a config: ``{"env": NAME}``, ``{"file": PATH}``, a string (the value) or a Secret;
        ``ValueError`` names ``what`` and the valid forms (never the value)."""
        if isinstance(raw, Secret):
            return raw
        if isinstance(raw, str) and raw:
            return cls(value=raw)
        if isinstance(raw, dict) and len(raw) == 1 and set(raw) <= {"env", "file"} and isinstance(next(iter(raw.values())), str):
            return cls(**raw)
        shown = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"{what} must be {{env: VARIABLE}}, {{file: PATH}} or a non-empty string; got {shown}")

    def reveal(self) -> str:
        """The secret's value; ``ValueError`` names the variable or file that lacks it."""
        if self.value is not None:
            return self.value
        if self.env is not None:
            value = os.environ.get(self.env, "")
            if not value:
                raise ValueError(f"the environment variable {self.env} is not set (or empty) in this process on {os.uname().nodename}")
            return value
        try:
            value = Path(self.file).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read the secret file {self.file}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"the secret file {self.file} is empty")
        return value

    @property
    def inline(self) -> bool:
        """Whether the value is in the config itself (not read from an environment variable or a file)."""
        return self.value is not None

    def __repr__(self) -> str:
        return f"Secret(env={self.env!r})" if self.env else f"Secret(file={self.file!r})" if self.file else "Secret(<inline>)"


def matches(presented: str | None, keys: Sequence[str]) -> bool:
    """Whether ``presented`` is one of ``keys``, compared in constant time with every key."""
    given = (presented or "").encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key.encode())
    return found


def loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server to this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it resolves to whatever the network says
