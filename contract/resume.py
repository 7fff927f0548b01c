"""Resuming a generation on another replica: the request field that carries the tokens already sent, and the
error code of a replica's hand-back frame."""

from __future__ import annotations

CONTINUATION = "continuation"  # request body field (chat and completions), a kvfleet extension
CONTINUATION_CHOICES = "choices"  # list of {"index": int, "token_ids": [int], "finished": bool}
DRAINING_CODE = "draining"  # the error code a replica's hand-back frame carries (exists today)
