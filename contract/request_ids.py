"""vLLM's request ids, as the replicas and the fleet gateway share them: the header that names a request, and
what an id may hold."""

import re

REQUEST_ID_HEADER = "X-Request-Id"
# Visible ASCII without spaces, 1 to 256 characters, as an id written into logs and headers must be.
REQUEST_ID_PATTERN = r"[\x21-\x7e]{1,256}"


def usable_request_id(header: str | None) -> str | None:
    """The header's value where it can name a request, else None: a tracing header that cannot is passed
    over, not a reason to refuse the request (as W3C trace context passes over a malformed traceparent)."""
    return header if header is not None and re.fullmatch(REQUEST_ID_PATTERN, header) else None
