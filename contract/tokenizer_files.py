"""The model files a router reads to tokenize prompts as a replica does, and where a replica serves them.

A replica answers GET TOKENIZER_FILES_PATH with `{"files": {NAME: BASE64}}`: those of FILES its model
folder holds (the tokenizer's from its tokenizer folder, the chat template the server renders with), never
weights, MAX_TOTAL_BYTES at most. The path needs no API key, as /metrics: a router holds none.
"""

from __future__ import annotations

TOKENIZER_FILES_PATH = "/kvfleet/tokenizer"
# Read from the tokenizer's folder.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# Read from the model's folder: its rope and vision settings, and its image preprocessor's.
MODEL_FILES = ("config.json", "preprocessor_config.json", "processor_config.json")
FILES = TOKENIZER_FILES + MODEL_FILES
# A large vocabulary's tokenizer.json is some 30 MB; the others are small.
MAX_TOTAL_BYTES = 64 * 1024 * 1024
