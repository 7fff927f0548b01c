"""The tokenizer of a made model: a byte-level BPE trained on the English prose in `data/corpus.txt`, with
the special tokens and chat template of the architecture's family."""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

# Both templates show the model the tools it may call and render the calls of earlier assistant turns in the
# format their --tool-call-parser reads: hermes for ChatML (Qwen's), llama3_json for Llama 3's. Tool results
# come back as `tool` turns (Llama 3 names that role `ipython`).
CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions. Their signatures are within "
    "<tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\n</tools>\\n\\nFor each call, answer with <tool_call>\\n{"name": function name, "arguments": '
    "arguments object}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen3's: with `enable_thinking` false (a chat_template_kwargs variable) the generation prompt holds an empty
# reasoning block, and the model answers at once; otherwise the model opens its answer with <think>.
QWEN3_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}",
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call these functions. To call them, answer "
    'with only {"name": function name, "parameters": arguments object}, calls separated by "; ".\' }}'
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role'])"
    " + '<|end_header_id|>\\n\\n' }}"
    "{% if message.get('tool_calls') %}"
    "{% for call in message['tool_calls'] %}"
    "{{ ('' if loop.first else '; ') + '{\"name\": ' + (call['function']['name'] | tojson)"
    " + ', \"parameters\": ' + (call['function']['arguments'] | tojson) + '}' }}"
    "{% endfor %}"
    "{% else %}{{ message['content'] | trim }}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerStyle:
    special_tokens: tuple[str, ...]
    bos_token: str | None
    eos_token: str  # ends a chat turn
    end_of_text: str
    chat_template: str
    # Special tokens a processor reads from the tokenizer by name (image_token, ...).
    named_tokens: tuple[tuple[str, str], ...] = ()
    # Tokens that are not special (decoded into text like words), the last ids of the vocabulary.
    plain_tokens: tuple[str, ...] = ()


LLAMA_STYLE = TokenizerStyle(
    special_tokens=(
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ),
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    end_of_text="<|end_of_text|>",
    chat_template=LLAMA3_TEMPLATE,
)
QWEN_STYLE = TokenizerStyle(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    end_of_text="<|endoftext|>",
    chat_template=CHATML_TEMPLATE,
)
# Qwen3's tokenizer has its reasoning tags as tokens, which decode into the text as Qwen3's do.
QWEN3_STYLE = replace(QWEN_STYLE, chat_template=QWEN3_TEMPLATE, plain_tokens=("<think>", "</think>"))


def corpus_text() -> str:
    """The English prose the tokenizers (and, with train_steps, the weights) are trained on."""
    return resources.files("kvfleet.runtime.models").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(style: TokenizerStyle, vocab_size: int, *, add_bos: bool) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = corpus_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(style.plain_tokens),
        min_frequency=1,
        special_tokens=list(style.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in style.plain_tokens])
    if add_bos and style.bos_token is not None:
        bos = (style.bos_token, tokenizer.token_to_id(style.bos_token))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(style: TokenizerStyle, model_max_length: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos_token,
        "eos_token": style.eos_token,
        "pad_token": style.end_of_text,
        "unk_token": None,
        "additional_special_tokens": [
            t for t in style.special_tokens if t not in (style.bos_token, style.eos_token)
        ],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": style.chat_template,
        **({"extra_special_tokens": dict(style.named_tokens)} if style.named_tokens else {}),
    }


def generation_config(style: TokenizerStyle, special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": special_ids.get(style.bos_token) if style.bos_token else None,
        "eos_token_id": [special_ids[style.eos_token], special_ids[style.end_of_text]],
        "pad_token_id": special_ids[style.end_of_text],
    }
