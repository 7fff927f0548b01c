"""Write a small, randomly initialised Hugging Face model folder that every loader accepts.

The folder holds config.json (the real architecture name), model.safetensors (seeded random weights under
the checkpoint's usual tensor names), and a byte-level BPE tokenizer trained on the English prose shipped in
`data/corpus.txt`, with a chat template in the style of the architecture's family.

With train_steps, the random weights are then trained on that same corpus (next-token prediction, on the
CPU, a few minutes for the small preset): models made so, whatever their size or seed, continue a text from
the corpus alike, which gives speculative decoding's draft models something real to agree on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    # A CLIP vision tower and a projector in front of a Llama language model.
    "llava": ("LlavaForConditionalGeneration", "llava"),
    # A Whisper-style audio encoder and a projector in front of a Qwen2 language model.
    "qwen2-audio": ("Qwen2AudioForConditionalGeneration", "qwen2_audio"),
    # Qwen2.5-Omni's thinker: a vision transformer and an audio encoder in front of a Qwen2 language model
    # with M-RoPE.
    "qwen2.5-omni": ("Qwen2_5OmniThinkerForConditionalGeneration", "qwen2_5_omni_thinker"),
}
# The language model of each multimodal architecture.
_TEXT_ARCHITECTURES = {"llava": "llama", "qwen2-audio": "qwen2", "qwen2.5-omni": "qwen2"}
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 176, 1024, 2048),
    "small": Preset(512, 8, 8, 2, 1408, 8192, 2048),
    # A draft model for `small` in speculative decoding: the same vocabulary (hence the same tokenizer), a
    # sixteenth of the layers' width and a quarter of their number.
    "small-draft": Preset(128, 2, 4, 2, 352, 8192, 2048),
}

_INIT_STD = 0.02
# Standard deviations of attention scores and of logits that the random weights aim for.
_ATTENTION_SCORE_STD = 2.0
_LOGIT_STD = 2.5
# Weight on the constant hidden dimension for ids the tokenizer lacks (see _suppress_unused_ids).
_UNUSED_ID_WEIGHT = -100.0

# Both templates show the model the tools it may call and render the calls of earlier assistant turns in the
# format their --tool-call-parser reads: hermes for ChatML (Qwen's), llama3_json for Llama 3's. Tool results
# come back as `tool` turns (Llama 3 names that role `ipython`).
_CHATML_TEMPLATE = (
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
_LLAMA3_TEMPLATE = (
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


_LLAMA_STYLE = TokenizerStyle(
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
    chat_template=_LLAMA3_TEMPLATE,
)
# LLaVA's template renders an image content part as the image token, which the processor (or the engine)
# then repeats once per image embedding.
_LLAVA_TEMPLATE = _LLAMA3_TEMPLATE.replace(
    "{% else %}{{ message['content'] | trim }}{% endif %}",
    "{% elif message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}{% endif %}",
)
IMAGE_TOKEN = "<image>"
_LLAVA_STYLE = replace(
    _LLAMA_STYLE, special_tokens=(*_LLAMA_STYLE.special_tokens, IMAGE_TOKEN), chat_template=_LLAVA_TEMPLATE
)
_QWEN_STYLE = TokenizerStyle(
    special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token=None,
    eos_token="<|im_end|>",
    end_of_text="<|endoftext|>",
    chat_template=_CHATML_TEMPLATE,
)
# Qwen2-Audio's template renders an audio content part as the audio token between its begin and end
# markers; the processor (or the engine) then repeats the audio token once per audio embedding.
AUDIO_TOKEN = "<|AUDIO|>"
_AUDIO_MARKERS = ("<|audio_bos|>", "<|audio_eos|>")  # a clip's begin and end
_QWEN2_AUDIO_TEMPLATE = _CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'audio' %}{{ '"
    + _AUDIO_MARKERS[0]
    + AUDIO_TOKEN
    + _AUDIO_MARKERS[1]
    + "' }}{% endif %}"
    "{% endfor %}{% endif %}",
)
# Qwen2.5-Omni's renders an image part as the image token between the vision markers, an audio part as
# Qwen2-Audio's does (with its own token names).
OMNI_IMAGE_TOKEN, OMNI_AUDIO_TOKEN, OMNI_VIDEO_TOKEN = "<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>"
_VISION_MARKERS = ("<|vision_bos|>", "<|vision_eos|>")
_OMNI_TEMPLATE = _CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}",
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '"
    + _VISION_MARKERS[0]
    + OMNI_IMAGE_TOKEN
    + _VISION_MARKERS[1]
    + "' }}"
    "{% elif part['type'] == 'audio' %}{{ '"
    + _AUDIO_MARKERS[0]
    + OMNI_AUDIO_TOKEN
    + _AUDIO_MARKERS[1]
    + "' }}{% endif %}"
    "{% endfor %}{% endif %}",
)
_OMNI_STYLE = replace(
    _QWEN_STYLE,
    special_tokens=(
        *_QWEN_STYLE.special_tokens,
        OMNI_IMAGE_TOKEN,
        OMNI_AUDIO_TOKEN,
        OMNI_VIDEO_TOKEN,
        *_VISION_MARKERS,
        *_AUDIO_MARKERS,
    ),
    chat_template=_OMNI_TEMPLATE,
    named_tokens=(
        ("image_token", OMNI_IMAGE_TOKEN),
        ("audio_token", OMNI_AUDIO_TOKEN),
        ("video_token", OMNI_VIDEO_TOKEN),
        ("vision_bos_token", _VISION_MARKERS[0]),
        ("vision_eos_token", _VISION_MARKERS[1]),
        ("audio_bos_token", _AUDIO_MARKERS[0]),
        ("audio_eos_token", _AUDIO_MARKERS[1]),
    ),
)
_QWEN2_AUDIO_STYLE = replace(
    _QWEN_STYLE,
    special_tokens=(*_QWEN_STYLE.special_tokens, AUDIO_TOKEN, *_AUDIO_MARKERS),
    chat_template=_QWEN2_AUDIO_TEMPLATE,
)


def make_model(
    arch: str,
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int | None = None,
    rope_parameters: dict[str, Any] | None = None,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
    train_steps: int = 0,
    teacher: str | Path | None = None,
) -> Path:
    """Write the folder; returns its path. Raises ValueError for unknown choices or a non-empty folder.

    max_position_embeddings and rope_parameters (Transformers' `rope_parameters`, rope_theta included)
    replace the preset's and the architecture's, e.g. to make a model with another RoPE scaling.
    sliding_window gives Mistral a window on every layer, and Qwen one on the layers from
    max_window_layers on (Llama has none). train_steps then trains the weights on the tokenizer's corpus:
    to predict its next tokens, or, given a teacher model folder of the same tokenizer, to predict the
    teacher's next-token distributions (knowledge distillation, as draft models are made)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if train_steps < 0:
        raise ValueError(f"train_steps must not be negative, got {train_steps}")
    if teacher is not None and not train_steps:
        raise ValueError("a teacher is learnt from in training: give train_steps too")
    if arch in _TEXT_ARCHITECTURES and train_steps:
        raise ValueError(f"train_steps trains text-only models; {arch}'s are not trained")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)

    style = {"llava": _LLAVA_STYLE, "qwen2-audio": _QWEN2_AUDIO_STYLE, "qwen2.5-omni": _OMNI_STYLE}.get(
        arch, _QWEN_STYLE if arch.startswith("qwen") else _LLAMA_STYLE
    )
    spec = PRESETS[preset]
    if max_position_embeddings is not None:
        if max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be positive, got {max_position_embeddings}")
        spec = replace(spec, max_position_embeddings=max_position_embeddings)
    tokenizer = _train_tokenizer(style, spec.vocab_size, add_bos=style.bos_token is not None)
    tokenizer.save(str(out / "tokenizer.json"))
    special_ids = {token: tokenizer.token_to_id(token) for token in style.special_tokens}
    text_arch = _TEXT_ARCHITECTURES.get(arch, arch)
    config = _config(text_arch, spec, style, special_ids, dtype)
    if rope_parameters is not None:
        config["rope_parameters"] = rope_parameters
    if sliding_window is not None:
        if text_arch == "llama" or sliding_window < 1:
            raise ValueError(
                f"sliding_window needs a positive window on mistral or qwen, got {arch} {sliding_window}"
            )
        config["sliding_window"] = sliding_window
        if text_arch.startswith("qwen"):
            config.update(use_sliding_window=True, max_window_layers=max_window_layers)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(style, spec))
    _write_json(out / "generation_config.json", _generation_config(style, special_ids))
    tensors = _random_weights(config, seed, num_used_ids=tokenizer.get_vocab_size())
    if arch == "llava":
        config = _llava_config(config, VISION_PRESETS[preset], special_ids[IMAGE_TOKEN])
        tensors = _llava_weights(tensors, config, seed)
        _write_llava_processor(out, config)
    elif arch == "qwen2-audio":
        config = _qwen2_audio_config(config, AUDIO_PRESETS[preset], special_ids[AUDIO_TOKEN])
        tensors = _qwen2_audio_weights(tensors, config, seed)
        _write_qwen2_audio_processor(out, config)
    elif arch == "qwen2.5-omni":
        config = _omni_config(config, OMNI_VISION_PRESETS[preset], AUDIO_PRESETS[preset], special_ids)
        tensors = _omni_weights(tensors, config, seed)
        _write_omni_processor(out, config, preset)
    _write_json(out / "config.json", config)
    _save_weights(out / "model.safetensors", tensors, config["dtype"])
    if train_steps:
        _train(out, tokenizer, train_steps, seed, None if teacher is None else _teacher(Path(teacher), out))
    return out


# Training: windows of this many tokens, this many per step, Adam at this rate after a linear warm-up.
_TRAIN_WINDOW = 128
_TRAIN_BATCH = 8
_TRAIN_LEARNING_RATE = 3e-3
_TRAIN_WARMUP_STEPS = 20


def _teacher(teacher: Path, student: Path) -> Any:
    """The teacher folder's model, in inference mode, once its tokenizer is the student's."""
    import torch
    from transformers import AutoModelForCausalLM

    if not (teacher / "tokenizer.json").is_file():
        raise ValueError(f"the teacher {teacher} has no tokenizer.json")
    if (teacher / "tokenizer.json").read_bytes() != (student / "tokenizer.json").read_bytes():
        raise ValueError(f"the teacher {teacher} has another tokenizer than this preset's")
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    vocab_size = json.loads((student / "config.json").read_text())["vocab_size"]
    if model.config.vocab_size != vocab_size:
        raise ValueError(f"the teacher has {model.config.vocab_size} token ids, this preset {vocab_size}")
    return model


def _train(folder: Path, tokenizer: Any, steps: int, seed: int, teacher: Any | None) -> None:
    """Train the folder's weights for `steps` steps on the corpus and write them back in their dtype: toward
    the corpus's next tokens, or toward the teacher's next-token distributions when a teacher is given."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    corpus = torch.tensor(tokenizer.encode(corpus_text(), add_special_tokens=False).ids)
    window = min(_TRAIN_WINDOW, len(corpus) - 1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_TRAIN_LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / _TRAIN_WARMUP_STEPS)
    )
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(corpus) - window, (_TRAIN_BATCH,), generator=generator)
        inputs = torch.stack([corpus[start : start + window] for start in starts.tolist()])
        if teacher is None:
            loss = model(input_ids=inputs, labels=inputs.clone()).loss
        else:
            with torch.no_grad():
                target = F.log_softmax(teacher(input_ids=inputs).logits.flatten(0, 1), dim=-1)
            predicted = F.log_softmax(model(input_ids=inputs).logits.flatten(0, 1), dim=-1)
            loss = F.kl_div(predicted, target, log_target=True, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    dtype = getattr(torch, model.config.dtype) if isinstance(model.config.dtype, str) else model.config.dtype
    weights = folder / "model.safetensors"
    tensors = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)


def corpus_text() -> str:
    """The English prose the tokenizers (and, with train_steps, the weights) are trained on."""
    return resources.files("kvfleet.runtime.models").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def _train_tokenizer(style: TokenizerStyle, vocab_size: int, *, add_bos: bool) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    corpus = corpus_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(style.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer)
    if add_bos and style.bos_token is not None:
        bos = (style.bos_token, tokenizer.token_to_id(style.bos_token))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _config(
    arch: str, spec: Preset, style: TokenizerStyle, special_ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    architecture, model_type = ARCHITECTURES[arch]
    head_dim = spec.hidden_size // spec.num_attention_heads
    if arch == "qwen3" and spec.hidden_size < 256:
        head_dim *= 2  # Qwen3's head_dim is independent of hidden_size; exercise that on the tiny preset
    eos_ids = [special_ids[style.eos_token], special_ids[style.end_of_text]]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": _INIT_STD,
        "rms_norm_eps": 1e-6 if arch.startswith("qwen") else 1e-5,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "bos_token_id": special_ids.get(style.bos_token) if style.bos_token else None,
        "eos_token_id": eos_ids[0] if arch.startswith("qwen") else eos_ids,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": dtype,
    }
    if arch == "llama":
        # Llama 3.1 scaling with a short original context, so the scaled band falls inside short prompts too.
        config["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings // 8,
        }
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "mistral":
        config["sliding_window"] = None
    if arch.startswith("qwen"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_hidden_layers)
    if arch == "qwen3":
        config["attention_bias"] = False
    return config


def _tokenizer_config(style: TokenizerStyle, spec: Preset) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos_token,
        "eos_token": style.eos_token,
        "pad_token": style.end_of_text,
        "unk_token": None,
        "additional_special_tokens": [
            t for t in style.special_tokens if t not in (style.bos_token, style.eos_token)
        ],
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": style.chat_template,
        **({"extra_special_tokens": dict(style.named_tokens)} if style.named_tokens else {}),
    }


def _generation_config(style: TokenizerStyle, special_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": special_ids.get(style.bos_token) if style.bos_token else None,
        "eos_token_id": [special_ids[style.eos_token], special_ids[style.end_of_text]],
        "pad_token_id": special_ids[style.end_of_text],
    }


def _random_weights(config: dict[str, Any], seed: int, *, num_used_ids: int) -> dict[str, Any]:
    """Random weights scaled so that activations stay near unit size, attention is selective (scores of a
    few units) and logits are peaked: greedy outputs then depend on the whole context, not the last token."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    head_dim = config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    query_key_std = (_ATTENTION_SCORE_STD / hidden) ** 0.5
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        for name, rows, std in (
            ("q_proj", q_rows, query_key_std),
            ("k_proj", kv_rows, query_key_std),
            ("v_proj", kv_rows, hidden**-0.5),
        ):
            tensors[f"{prefix}.self_attn.{name}.weight"] = normal(rows, hidden, std=std)
            if config["model_type"] == "qwen2":
                tensors[f"{prefix}.self_attn.{name}.bias"] = normal(rows, std=0.1)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = normal(hidden, q_rows, std=q_rows**-0.5)
        if config["model_type"] == "qwen3":
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.ones(head_dim)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(head_dim)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(inter, hidden, std=hidden**-0.5)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(hidden, inter, std=inter**-0.5)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(vocab, hidden, std=_LOGIT_STD * hidden**-0.5)
    if num_used_ids < vocab:
        _suppress_unused_ids(tensors, num_used_ids)
    return tensors


def _save_weights(path: Path, tensors: dict[str, Any], dtype_name: str) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    path.chmod(0o644)


def _suppress_unused_ids(tensors: dict[str, Any], num_used_ids: int) -> None:
    """Make ids past the tokenizer's vocabulary (padding) unlikely, as training would.

    Hidden dimension 0 becomes a constant 1: every embedding holds it and no layer reads or writes that
    dimension, so after the final norm it is positive for every token (1 / rms of the last hidden state).
    The lm_head rows of unused ids weigh it negatively, which acts as a large negative bias.
    """
    tensors["model.embed_tokens.weight"][:, 0] = 1.0
    for name, tensor in tensors.items():
        if name.endswith(
            ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
        ):
            tensor[:, 0] = 0.0
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor[0] = 0.0
    lm_head = tensors["lm_head.weight"]
    lm_head[:, 0] = 0.0
    lm_head[num_used_ids:, 0] = _UNUSED_ID_WEIGHT


@dataclass(frozen=True)
class VisionPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int


# The CLIP tower of each preset: (image_size / patch_size)^2 image tokens, 25 for tiny and 256 for small
# (LLaVA 1.5's 336 / 14 gives 576).
VISION_PRESETS: dict[str, VisionPreset] = {
    "tiny": VisionPreset(32, 64, 2, 2, 30, 6),
    "small": VisionPreset(256, 1024, 4, 4, 224, 14),
    "small-draft": VisionPreset(32, 64, 2, 2, 30, 6),
}
# What LLaVA's and Qwen2.5-Omni's image processors do after resizing: scale to [0, 1], then OpenAI CLIP's
# normalisation.
_CLIP_PIXEL_STEPS = {
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_convert_rgb": True,
}


def _llava_config(text_config: dict[str, Any], vision: VisionPreset, image_token_id: int) -> dict[str, Any]:
    text = {key: value for key, value in text_config.items() if key not in ("architectures", "dtype")}
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": image_token_id,
        "image_seq_length": (vision.image_size // vision.patch_size) ** 2,
        "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_hidden_layers": vision.num_hidden_layers,
            "num_attention_heads": vision.num_attention_heads,
            "image_size": vision.image_size,
            "patch_size": vision.patch_size,
            "num_channels": 3,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "projection_dim": text_config["hidden_size"],
        },
        "dtype": text_config["dtype"],
    }


def _llava_weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors under LLaVA's names, plus a random CLIP tower and projector scaled so
    that image embeddings have the size of token embeddings (and the constant dimension 0 that
    _suppress_unused_ids gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    vision = config["vision_config"]
    width = vision["hidden_size"]
    inner = vision["intermediate_size"]
    text_hidden = config["text_config"]["hidden_size"]
    num_patches = (vision["image_size"] // vision["patch_size"]) ** 2

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = _language_model_tensors(text_tensors)
    tower = "model.vision_tower.vision_model"
    patch_inputs = 3 * vision["patch_size"] ** 2
    tensors[f"{tower}.embeddings.class_embedding"] = normal(width, std=1.0)
    tensors[f"{tower}.embeddings.patch_embedding.weight"] = normal(
        width, 3, vision["patch_size"], vision["patch_size"], std=patch_inputs**-0.5
    )
    tensors[f"{tower}.embeddings.position_embedding.weight"] = normal(num_patches + 1, width, std=0.5)
    for norm in ("pre_layrnorm", "post_layernorm"):
        tensors[f"{tower}.{norm}.weight"] = torch.ones(width)
        tensors[f"{tower}.{norm}.bias"] = torch.zeros(width)
    for i in range(vision["num_hidden_layers"]):
        tensors |= _encoder_layer_weights(
            f"{tower}.encoder.layers.{i}",
            width,
            inner,
            normal,
            norms=("layer_norm1", "layer_norm2"),
            mlp="mlp.",
        )
    projector = "model.multi_modal_projector"
    tensors[f"{projector}.linear_1.weight"] = normal(text_hidden, width, std=width**-0.5)
    tensors[f"{projector}.linear_1.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.linear_2.weight"] = normal(text_hidden, text_hidden, std=2 * text_hidden**-0.5)
    tensors[f"{projector}.linear_2.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.linear_2.weight"][0] = 0.0
    tensors[f"{projector}.linear_2.bias"][0] = 1.0
    return tensors


def _encoder_layer_weights(
    prefix: str,
    width: int,
    inner: int,
    normal: Any,
    *,
    norms: tuple[str, str],
    mlp: str,
    key_bias: bool = True,
) -> dict[str, Any]:
    """A random pre-norm encoder layer (CLIP's or Whisper's): its two norms' names, and the prefix of its
    MLP's fc1 and fc2."""
    import torch

    tensors = {}
    for norm in norms:
        tensors[f"{prefix}.{norm}.weight"] = torch.ones(width)
        tensors[f"{prefix}.{norm}.bias"] = torch.zeros(width)
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        tensors[f"{prefix}.self_attn.{name}.weight"] = normal(width, width, std=width**-0.5)
        if key_bias or name != "k_proj":
            tensors[f"{prefix}.self_attn.{name}.bias"] = normal(width, std=0.02)
    tensors[f"{prefix}.{mlp}fc1.weight"] = normal(inner, width, std=width**-0.5)
    tensors[f"{prefix}.{mlp}fc1.bias"] = normal(inner, std=0.02)
    tensors[f"{prefix}.{mlp}fc2.weight"] = normal(width, inner, std=inner**-0.5)
    tensors[f"{prefix}.{mlp}fc2.bias"] = normal(width, std=0.02)
    return tensors


def _whisper_weights(tower: str, audio: dict[str, Any], normal: Any) -> dict[str, Any]:
    """A random Whisper-style audio encoder's convolutions and layers (Whisper's names; its keys have no
    bias)."""
    width, mel_bins = audio["d_model"], audio["num_mel_bins"]
    tensors = {
        f"{tower}.conv1.weight": normal(width, mel_bins, 3, std=(3 * mel_bins) ** -0.5),
        f"{tower}.conv1.bias": normal(width, std=0.02),
        f"{tower}.conv2.weight": normal(width, width, 3, std=(3 * width) ** -0.5),
        f"{tower}.conv2.bias": normal(width, std=0.02),
    }
    for i in range(audio["encoder_layers"]):
        tensors |= _encoder_layer_weights(
            f"{tower}.layers.{i}",
            width,
            audio["encoder_ffn_dim"],
            normal,
            norms=("self_attn_layer_norm", "final_layer_norm"),
            mlp="",
            key_bias=False,
        )
    return tensors


def _language_model_tensors(text_tensors: dict[str, Any]) -> dict[str, Any]:
    """A text model's tensors under a multimodal model's names (Transformers 5's layout)."""
    return {
        (
            "lm_head.weight"
            if name == "lm_head.weight"
            else "model.language_model." + name.removeprefix("model.")
        ): tensor
        for name, tensor in text_tensors.items()
    }


def _write_llava_processor(out: Path, config: dict[str, Any]) -> None:
    """preprocessor_config.json and processor_config.json, as LLaVA 1.5 ships them (CLIP's resize to the
    shortest edge, centre crop and normalisation), for Transformers' LlavaProcessor and the engine alike."""
    vision = config["vision_config"]
    size = vision["image_size"]
    _write_json(
        out / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            **_CLIP_PIXEL_STEPS,
        },
    )
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "image_token": IMAGE_TOKEN,
            "patch_size": vision["patch_size"],
            "vision_feature_select_strategy": config["vision_feature_select_strategy"],
            "num_additional_image_tokens": 1,
        },
    )
    (out / "chat_template.jinja").write_text(_LLAVA_TEMPLATE, encoding="utf-8")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class AudioPreset:
    d_model: int
    encoder_ffn_dim: int
    encoder_layers: int
    encoder_attention_heads: int
    num_mel_bins: int


# The audio encoder of each preset. Every one takes Whisper's 30 s window (3000 mel frames, 750 audio tokens
# at most; a second of audio gives 25); Qwen2-Audio's own is 1280 wide, 32 layers deep, on 128 mel bins.
AUDIO_PRESETS: dict[str, AudioPreset] = {
    "tiny": AudioPreset(32, 64, 2, 2, 80),
    "small": AudioPreset(256, 1024, 4, 4, 128),
    "small-draft": AudioPreset(32, 64, 2, 2, 80),
}
_AUDIO_SAMPLING_RATE = 16000
_AUDIO_HOP_LENGTH = 160  # samples per mel frame
_AUDIO_WINDOW_S = 30
_AUDIO_MAX_SOURCE_POSITIONS = _AUDIO_WINDOW_S * _AUDIO_SAMPLING_RATE // _AUDIO_HOP_LENGTH // 2


def _whisper_audio_config(audio: AudioPreset) -> dict[str, Any]:
    """A Whisper-style audio encoder's settings (Qwen2-Audio's and Qwen2.5-Omni's)."""
    return {
        "d_model": audio.d_model,
        "encoder_ffn_dim": audio.encoder_ffn_dim,
        "encoder_layers": audio.encoder_layers,
        "encoder_attention_heads": audio.encoder_attention_heads,
        "num_mel_bins": audio.num_mel_bins,
        "max_source_positions": _AUDIO_MAX_SOURCE_POSITIONS,
        "activation_function": "gelu",
        "scale_embedding": False,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
    }


def _qwen2_audio_config(
    text_config: dict[str, Any], audio: AudioPreset, audio_token_id: int
) -> dict[str, Any]:
    text = {key: value for key, value in text_config.items() if key not in ("architectures", "dtype")}
    return {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_token_index": audio_token_id,
        "tie_word_embeddings": False,
        "text_config": text,
        "audio_config": {**_whisper_audio_config(audio), "model_type": "qwen2_audio_encoder"},
        "dtype": text_config["dtype"],
    }


def _qwen2_audio_weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors under Qwen2-Audio's names, plus a random audio encoder and projector
    scaled so that audio embeddings have the size of token embeddings (and the constant dimension 0 that
    _suppress_unused_ids gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    audio = config["audio_config"]
    width = audio["d_model"]
    text_hidden = config["text_config"]["hidden_size"]

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = _language_model_tensors(text_tensors)
    tower = "model.audio_tower"
    tensors |= _whisper_weights(tower, audio, normal)
    tensors[f"{tower}.embed_positions.weight"] = normal(audio["max_source_positions"], width, std=0.5)
    tensors[f"{tower}.layer_norm.weight"] = torch.ones(width)
    tensors[f"{tower}.layer_norm.bias"] = torch.zeros(width)
    projector = "model.multi_modal_projector.linear"
    tensors[f"{projector}.weight"] = normal(text_hidden, width, std=width**-0.5)
    tensors[f"{projector}.bias"] = normal(text_hidden, std=0.02)
    tensors[f"{projector}.weight"][0] = 0.0
    tensors[f"{projector}.bias"][0] = 1.0
    return tensors


def _whisper_feature_extractor(audio: dict[str, Any]) -> dict[str, Any]:
    """WhisperFeatureExtractor's settings for the encoder's 30 s window."""
    num_frames = 2 * audio["max_source_positions"]
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": audio["num_mel_bins"],
        "sampling_rate": _AUDIO_SAMPLING_RATE,
        "hop_length": _AUDIO_HOP_LENGTH,
        "chunk_length": _AUDIO_WINDOW_S,
        "n_fft": 400,
        "n_samples": num_frames * _AUDIO_HOP_LENGTH,
        "nb_max_frames": num_frames,
        "padding_side": "right",
        "padding_value": 0.0,
        "dither": 0.0,
        "return_attention_mask": True,
    }


def _write_qwen2_audio_processor(out: Path, config: dict[str, Any]) -> None:
    """preprocessor_config.json (Whisper's log-mel features, as Qwen2-Audio ships them) and
    processor_config.json, for Transformers' Qwen2AudioProcessor and the engine alike."""
    _write_json(
        out / "preprocessor_config.json",
        {**_whisper_feature_extractor(config["audio_config"]), "processor_class": "Qwen2AudioProcessor"},
    )
    _write_json(
        out / "processor_config.json",
        {
            "processor_class": "Qwen2AudioProcessor",
            "audio_token": AUDIO_TOKEN,
            "audio_bos_token": _AUDIO_MARKERS[0],
            "audio_eos_token": _AUDIO_MARKERS[1],
        },
    )
    (out / "chat_template.jinja").write_text(_QWEN2_AUDIO_TEMPLATE, encoding="utf-8")


@dataclass(frozen=True)
class OmniVisionPreset:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    # Blocks that attend over the whole image; the others attend within windows of window_size pixels.
    fullatt_block_indexes: tuple[int, ...]
    window_size: int
    # The largest image, in embeddings (of 28 x 28 pixels each); Qwen2.5-Omni's own takes 16384.
    max_image_tokens: int
    # The text model's heads' frequencies that turn with time, rows and columns.
    mrope_section: tuple[int, int, int]


OMNI_VISION_PRESETS: dict[str, OmniVisionPreset] = {
    "tiny": OmniVisionPreset(32, 64, 2, 2, (1,), 56, 64, (2, 3, 3)),
    "small": OmniVisionPreset(256, 1024, 4, 4, (1, 3), 112, 256, (8, 12, 12)),
    "small-draft": OmniVisionPreset(32, 64, 2, 2, (1,), 56, 64, (2, 6, 6)),
}
_OMNI_PATCH_SIZE = 14
_OMNI_MERGE_SIZE = 2


def _omni_config(
    text_config: dict[str, Any], vision: OmniVisionPreset, audio: AudioPreset, special_ids: dict[str, int]
) -> dict[str, Any]:
    text = {key: value for key, value in text_config.items() if key not in ("architectures", "dtype")}
    text["model_type"] = "qwen2_5_omni_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(vision.mrope_section)}
    hidden = text_config["hidden_size"]
    return {
        "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
        "model_type": "qwen2_5_omni_thinker",
        "image_token_index": special_ids[OMNI_IMAGE_TOKEN],
        "audio_token_index": special_ids[OMNI_AUDIO_TOKEN],
        "video_token_index": special_ids[OMNI_VIDEO_TOKEN],
        "vision_start_token_id": special_ids[_VISION_MARKERS[0]],
        "vision_end_token_id": special_ids[_VISION_MARKERS[1]],
        "audio_start_token_id": special_ids[_AUDIO_MARKERS[0]],
        "audio_end_token_id": special_ids[_AUDIO_MARKERS[1]],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {
            "model_type": "qwen2_5_omni_vision_encoder",
            "depth": vision.depth,
            "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size,
            "num_heads": vision.num_heads,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": _OMNI_PATCH_SIZE,
            "spatial_merge_size": _OMNI_MERGE_SIZE,
            "temporal_patch_size": 2,
            "window_size": vision.window_size,
            "fullatt_block_indexes": list(vision.fullatt_block_indexes),
            "out_hidden_size": hidden,
        },
        "audio_config": {
            **_whisper_audio_config(audio),
            "model_type": "qwen2_5_omni_audio_encoder",
            "n_window": 100,
            "output_dim": hidden,
        },
        "dtype": text_config["dtype"],
    }


def _omni_weights(text_tensors: dict[str, Any], config: dict[str, Any], seed: int) -> dict[str, Any]:
    """The language model's tensors (the thinker keeps a text model's names), plus a random vision
    transformer and audio encoder whose outputs have the size of token embeddings (and the constant
    dimension 0 that _suppress_unused_ids gives every token)."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    tensors = dict(text_tensors)
    hidden = config["text_config"]["hidden_size"]
    vision = config["vision_config"]
    width, inner = vision["hidden_size"], vision["intermediate_size"]
    patch = vision["patch_size"]
    tensors["visual.patch_embed.proj.weight"] = normal(
        width, 3, vision["temporal_patch_size"], patch, patch, std=(3 * 2 * patch * patch) ** -0.5
    )
    for i in range(vision["depth"]):
        prefix = f"visual.blocks.{i}"
        tensors[f"{prefix}.norm1.weight"] = torch.ones(width)
        tensors[f"{prefix}.norm2.weight"] = torch.ones(width)
        for name in ("q", "k", "v", "proj"):
            tensors[f"{prefix}.attn.{name}.weight"] = normal(width, width, std=width**-0.5)
            tensors[f"{prefix}.attn.{name}.bias"] = normal(width, std=0.02)
        for name, rows, columns in (
            ("gate_proj", inner, width),
            ("up_proj", inner, width),
            ("down_proj", width, inner),
        ):
            tensors[f"{prefix}.mlp.{name}.weight"] = normal(rows, columns, std=columns**-0.5)
            tensors[f"{prefix}.mlp.{name}.bias"] = normal(rows, std=0.02)
    merged = width * vision["spatial_merge_size"] ** 2
    tensors["visual.merger.ln_q.weight"] = torch.ones(width)
    tensors["visual.merger.mlp.0.weight"] = normal(merged, merged, std=merged**-0.5)
    tensors["visual.merger.mlp.0.bias"] = normal(merged, std=0.02)
    tensors["visual.merger.mlp.2.weight"] = normal(hidden, merged, std=2 * merged**-0.5)
    tensors["visual.merger.mlp.2.bias"] = normal(hidden, std=0.02)

    audio = config["audio_config"]
    width = audio["d_model"]
    tower = "audio_tower"
    tensors |= _whisper_weights(tower, audio, normal)
    tensors[f"{tower}.audio_bos_eos_token.weight"] = normal(2, hidden, std=1.0)
    tensors[f"{tower}.ln_post.weight"] = torch.ones(width)
    tensors[f"{tower}.ln_post.bias"] = torch.zeros(width)
    tensors[f"{tower}.proj.weight"] = normal(hidden, width, std=width**-0.5)
    tensors[f"{tower}.proj.bias"] = normal(hidden, std=0.02)
    for projection in ("visual.merger.mlp.2", f"{tower}.proj"):
        tensors[f"{projection}.weight"][0] = 0.0
        tensors[f"{projection}.bias"][0] = 1.0
    return tensors


def _write_omni_processor(out: Path, config: dict[str, Any], preset: str) -> None:
    """preprocessor_config.json (Qwen2-VL's image resizing and Whisper's log-mel features in one file, as
    Qwen2.5-Omni ships them), processor_config.json and the chat template, for Transformers'
    Qwen2_5OmniProcessor and the engine alike. The tokens' names are in tokenizer_config.json."""
    vision = config["vision_config"]
    pixels_per_token = (vision["patch_size"] * vision["spatial_merge_size"]) ** 2
    _write_json(
        out / "preprocessor_config.json",
        {
            **_whisper_feature_extractor(config["audio_config"]),
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5OmniProcessor",
            "do_resize": True,
            "resample": 3,
            "size": {
                "shortest_edge": 4 * pixels_per_token,
                "longest_edge": OMNI_VISION_PRESETS[preset].max_image_tokens * pixels_per_token,
            },
            **_CLIP_PIXEL_STEPS,
            "patch_size": vision["patch_size"],
            "temporal_patch_size": vision["temporal_patch_size"],
            "merge_size": vision["spatial_merge_size"],
        },
    )
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2_5OmniProcessor"})
    (out / "chat_template.jinja").write_text(_OMNI_TEMPLATE, encoding="utf-8")
