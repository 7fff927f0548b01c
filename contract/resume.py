"""The wire format of a continuation: a request resumed on another replica from the output tokens its
choices already delivered, when the replica serving it failed or handed it back mid-stream.

A continuation is the client's original body (chat or completions, streamed) plus one field, a kvfleet
extension: `{"continuation": {"choices": [{"index": 0, "token_ids": [...], "finished": false}, ...]}}`.
`index` is the OpenAI choice index (with several prompts, prompt_index * n + i); `token_ids` the output
tokens that choice already delivered; `finished` whether it already sent its finish_reason (it is not run
again, and sends nothing more, but its tokens count in usage). A choice absent from the list starts anew.
The replica continues each unfinished choice as if it had never stopped: greedy and seeded outputs are those
of an uninterrupted run.
"""

from __future__ import annotations

# The request body's field, on /v1/completions and /v1/chat/completions.
CONTINUATION = "continuation"
# Its list of {"index": int, "token_ids": [int], "finished": bool}.
CONTINUATION_CHOICES = "choices"
# The error code of the frame that ends a stream a draining replica hands back, for another to resume.
DRAINING_CODE = "draining"
