"""HTTPS for `kvfleet serve`, with vLLM's flags: the server's certificate and key, the CA bundle client
certificates are checked against and whether a client must present one, the ciphers, and loading the files
again when they change (a certificate that cert-manager renews in its Secret) without a restart."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# How often the files are looked at for a change, where --enable-ssl-refresh asks for it.
REFRESH_POLL_S = 1.0


class TlsSettingError(ValueError):
    """A TLS setting that cannot be used, with the flag that gave it."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class TlsFiles:
    """What the server's TLS is made of: uvicorn's settings, under vLLM's names."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE
    ciphers: str | None = None
    refresh: bool = False

    def refusal(self) -> tuple[str, str] | None:
        """The flag whose setting cannot be used, and why; None when the files load and the ciphers exist."""
        try:
            self.context()
        except TlsSettingError as exc:
            return exc.flag, str(exc)
        return None

    def context(self) -> ssl.SSLContext:
        """A server context of these files and settings, as uvicorn builds its own; TlsSettingError names
        the flag whose file does not load or whose ciphers this server lacks."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._load_chain(context)
        context.verify_mode = ssl.VerifyMode(self.cert_reqs)
        self._load_cas(context)
        if self.ciphers:
            try:
                context.set_ciphers(self.ciphers)
            except ssl.SSLError as exc:
                message = f"{self.ciphers!r} names no cipher this server has ({exc})"
                raise TlsSettingError("--ssl-ciphers", message) from None
        return context

    def _load_chain(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            files = self.certfile if self.keyfile is None else f"{self.certfile} and {self.keyfile}"
            message = f"the certificate and key in {files} do not load: {exc}"
            raise TlsSettingError("--ssl-certfile", message) from None

    def _load_cas(self, context: ssl.SSLContext) -> None:
        if self.ca_certs:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                message = f"the CA certificates in {self.ca_certs} do not load: {exc}"
                raise TlsSettingError("--ssl-ca-certs", message) from None

    def stamps(self) -> tuple[tuple[int, int] | None, ...]:
        """Each file's modification time and size; None for one that is missing, as while the files of a
        mounted Secret are swapped."""
        stamps: list[tuple[int, int] | None] = []
        for path in (self.certfile, self.keyfile, self.ca_certs):
            if path is None:
                continue
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                stamps.append(None)
            else:
                stamps.append((stat.st_mtime_ns, stat.st_size))
        return tuple(stamps)

    def uvicorn_options(self) -> dict[str, Any]:
        """uvicorn.Config's settings for these files."""
        return {
            "ssl_certfile": self.certfile,
            "ssl_keyfile": self.keyfile,
            "ssl_ca_certs": self.ca_certs,
            "ssl_cert_reqs": self.cert_reqs,
            "ssl_ciphers": self.ciphers,
        }


async def refresh_on_change(files: TlsFiles, listening: ssl.SSLContext) -> None:
    """Builds a new context of the files whenever one of them changes, and hands it to the connections made
    after that (in the handshake, as the context a server name selects): they get the new certificate and
    trust the CA bundle as it now is (a certificate taken out of it no longer), while those already open
    keep theirs. Files that do not load, or are missing for a moment, leave the last context in
    use and are read again at their next change."""
    current = listening

    def hand_over(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        # Called for every handshake, with no server name as well (a client that connects to an address).
        connection.context = current

    listening.sni_callback = hand_over
    seen = files.stamps()
    while True:
        await asyncio.sleep(REFRESH_POLL_S)
        stamps = files.stamps()
        if stamps == seen or None in stamps:
            continue
        seen = stamps
        try:
            current = files.context()
        except TlsSettingError as exc:
            logger.warning("the TLS files changed but were not loaded: %s", exc)
            continue
        logger.info("the TLS certificate was loaded again from %s", files.certfile)
