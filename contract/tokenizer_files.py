"""The model files a router reads to tokenize prompts as a replica does, and where a replica serves them.

A replica answers GET TOKENIZER_FILES_PATH with `{"files": {NAME: BASE64}, "samples": SAMPLES,
"chat_rendering": RENDERING}`: those of FILES its model folder holds (the tokenizer's from its tokenizer
folder, the chat template the server renders with), never weights, MAX_TOTAL_BYTES at most; the token ids its
own tokenizer gives SAMPLE_TEXT and SAMPLE_MESSAGES (kvfleet.runtime.chat_prompt.sample_token_ids), which a
router's tokenization of the files must reproduce before it is used; and the settings by which it renders
chat prompts (kvfleet.runtime.serving.chat_rendering). The path needs no API key, as /metrics: a router holds
none.
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
# Text that exercises a tokenizer's normalisation, pre-tokenisation and special tokens added at its start
# or end; as a conversation, its chat template too.
SAMPLE_TEXT = "Tokenize me:  naïve café, 12 345\ttabs, 東京, and <b>markup</b>.\n"
SAMPLE_MESSAGES = (
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": SAMPLE_TEXT},
)
