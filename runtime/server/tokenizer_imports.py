"""Transformers' tokenizer and configuration classes for an API server process, imported without torch.

An API server process tokenizes, renders chat templates, detokenizes and reads the model folder's configs;
the EngineCore process runs the model. Transformers imports torch, and with it torch's compiler, whenever
torch is installed, though none of these classes uses it: on 2 cores that is about 5 s of a replica's start,
twice the rest of the API server's. So the first import of those classes takes place with torch marked as
missing (a None entry in `sys.modules`, which is how importlib spells it), and the mark is removed at once:
what needs torch later in the process (a LoRA adapter's check, an audio clip's features) imports it then.
"""

from __future__ import annotations

import logging
import sys

_TORCH = "torch"


def import_tokenizer_classes() -> None:
    """Imports Transformers' classes the API server uses, without torch where torch is not loaded yet."""
    if _TORCH in sys.modules:
        return
    # What Transformers says at its import without torch: that models cannot run here, as intended.
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addFilter(_drop)
    sys.modules[_TORCH] = None  # type: ignore[assignment]  # importlib's "not installed"
    try:
        import transformers  # noqa: F401
        from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase  # noqa: F401
    finally:
        del sys.modules[_TORCH]
        transformers_logger.removeFilter(_drop)


def _drop(_record: logging.LogRecord) -> bool:
    return False
