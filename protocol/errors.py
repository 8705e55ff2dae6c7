"""Errors raised by the protocol layer. Every message names the culprit (message kind, field, arena,
path) and, where there is one, the setting to change."""

from __future__ import annotations

from coli.errors import ColiError


class ProtocolError(ColiError):
    """An unknown, malformed, oversized or version-mismatched message.

    A receiving stage catches this, logs it and keeps running: one bad peer must not take a stage down.
    `peer` is the ROUTER identity the bad message came from, when known, so the stage can log or
    answer it.
    """

    def __init__(self, message: str, *, peer: bytes | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class ArenaError(ColiError):
    """A shared-memory arena cannot be created, attached, viewed, closed or unlinked as asked."""


class RunDirError(ColiError):
    """The run directory is unsafe (wrong owner or mode), unusable, or its socket paths are too long."""
