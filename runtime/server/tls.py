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
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for flag, load in (("--ssl-certfile", self._load_chain), ("--ssl-ca-certs", self._load_cas)):
            try:
                load(context)
            except ValueError as exc:
                return flag, str(exc)
        if self.ciphers:
            try:
                context.set_ciphers(self.ciphers)
            except ssl.SSLError as exc:
                return "--ssl-ciphers", f"{self.ciphers!r} names no cipher this server has ({exc})"
        return None

    def load_into(self, context: ssl.SSLContext) -> None:
        """The certificate and key, in place of the context's, and the CA certificates, beside its own;
        ValueError naming the file that does not load."""
        self._load_chain(context)
        self._load_cas(context)

    def _load_chain(self, context: ssl.SSLContext) -> None:
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as exc:
            files = self.certfile if self.keyfile is None else f"{self.certfile} and {self.keyfile}"
            raise ValueError(f"the certificate and key in {files} do not load: {exc}") from None

    def _load_cas(self, context: ssl.SSLContext) -> None:
        if self.ca_certs:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"the CA certificates in {self.ca_certs} do not load: {exc}") from None

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


async def refresh_on_change(files: TlsFiles, context: ssl.SSLContext) -> None:
    """Loads the files into the server's context again whenever one of them changes: connections made after
    that get the new certificate, those already open keep theirs. A CA bundle's new certificates are trusted
    from then on, and those taken out of it until the server restarts (a context's trust store only grows).
    Files that do not load, or are missing for a moment, leave the context as it was and are read again at
    their next change."""
    seen = files.stamps()
    while True:
        await asyncio.sleep(REFRESH_POLL_S)
        stamps = files.stamps()
        if stamps == seen or None in stamps:
            continue
        seen = stamps
        try:
            files.load_into(context)
        except ValueError as exc:
            logger.warning("the TLS files changed but were not loaded: %s", exc)
            continue
        logger.info("the TLS certificate was loaded again from %s", files.certfile)
