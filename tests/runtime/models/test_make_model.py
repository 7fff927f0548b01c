"""`kvfleet make-model` writes folders that Transformers loads as the named architecture, with a working
tokenizer and chat template, and random weights whose greedy outputs are not degenerate."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from kvfleet.runtime.models.make_model import corpus_text, make_model
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvfleet.cli import cli

EXPECTED = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
TEXT = "Clouds drift over the harbour while the soup simmers, and the server answers 42 requests."


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_transformers_loads_the_folder(arch: str, tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model(arch)
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = AutoConfig.from_pretrained(folder)
    assert (config.architectures[0], config.model_type) == EXPECTED[arch]
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == EXPECTED[arch][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == raw.encode(TEXT, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) < len(TEXT) / 2  # merges learned from the corpus, not bytes
    assert tokenizer.eos_token_id is not None and tokenizer.eos_token_id < config.vocab_size
    assert len(tokenizer) <= config.vocab_size


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chat_template_renders_the_family_format(arch: str, tiny_model: Callable[[str], Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(arch))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if arch == "llama":
        assert text == (
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        assert tokenizer.eos_token == "<|eot_id|>"
        assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id
    else:
        assert text == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert tokenizer.eos_token == "<|im_end|>"
        assert tokenizer.bos_token is None
    # Each special token of the template encodes as one id.
    header = "<|start_header_id|>" if arch == "llama" else "<|im_start|>"
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode(header, add_special_tokens=False)) == [header]


def test_qwen3_has_reasoning_tags_and_the_enable_thinking_switch(tiny_model: Callable[[str], Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen3"))
    messages = [{"role": "user", "content": "Hi there"}]
    thinking = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert thinking.endswith("<|im_start|>assistant\n")
    answering = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert answering == thinking + "<think>\n\n</think>\n\n"
    # Each tag is one token, and decodes into the text as Qwen3's do (they are not special).
    for tag in ("<think>", "</think>"):
        ids = tokenizer.encode(f"a{tag}b", add_special_tokens=False)
        assert tokenizer.convert_tokens_to_ids(tag) in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == f"a{tag}b"
    assert max(tokenizer.convert_tokens_to_ids(["<think>", "</think>"])) < len(tokenizer)


def test_greedy_outputs_depend_on_the_whole_prompt(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    questions = ["How long should soup simmer?", "Why is the sky blue?", "What is a cache?", "Will it rain?"]
    outputs = []
    for question in questions:
        # Chat prompts all end with the same assistant header: only attention can tell them apart.
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        tokens = out[0, ids.shape[1] :].tolist()
        assert len(set(tokens)) > 3, f"greedy output collapsed: {tokens}"
        outputs.append(tuple(tokens))
    assert len(set(outputs)) == len(questions)


def test_small_preset_is_about_30m_parameters_and_never_emits_padding_ids(tmp_path: Path) -> None:
    folder = make_model("qwen3", "small", tmp_path / "small", seed=3)
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (512, 8, 2)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118
    assert 28e6 < num_params < 34e6
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) < config["vocab_size"]  # the corpus yields fewer tokens than the padded vocabulary
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([tokenizer.encode(TEXT)])).logits[0]
    used, padding = logits[:, : len(tokenizer)], logits[:, len(tokenizer) :]
    assert (padding.max(dim=-1).values < used.max(dim=-1).values - 20).all()


def test_the_cli_writes_a_folder_and_rejects_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "m"
    result = runner.invoke(
        cli, ["make-model", "--arch", "mistral", "--preset", "tiny", "--seed", "5", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    again = runner.invoke(cli, ["make-model", "--arch", "mistral", str(out)])
    assert again.exit_code != 0 and "not empty" in again.output
    bad = runner.invoke(cli, ["make-model", "--arch", "gpt2", str(tmp_path / "x")])
    assert bad.exit_code != 0


def test_same_seed_same_weights_other_seed_other_weights(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> torch.Tensor:
        folder = make_model("llama", "tiny", tmp_path / name, seed=seed)
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return f.get_tensor("model.layers.0.self_attn.q_proj.weight")

    first = weights(1, "a")
    assert torch.equal(first, weights(1, "b"))
    assert not torch.equal(first, weights(2, "c"))


def test_bfloat16_weights_and_bad_choices(tmp_path: Path) -> None:
    folder = make_model("qwen2", "tiny", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown arch"):
        make_model("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown preset"):
        make_model("llama", "huge", tmp_path / "y")


def test_train_steps_fit_the_weights_to_the_corpus_and_report_each_steps_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def corpus_loss(folder: Path) -> float:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = torch.tensor([tokenizer.encode(corpus_text(), add_special_tokens=False)[:512]])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            return float(model(input_ids=ids, labels=ids).loss)

    untrained = corpus_loss(make_model("qwen3", "tiny", tmp_path / "untrained"))
    capsys.readouterr()
    trained = corpus_loss(make_model("qwen3", "tiny", tmp_path / "trained", train_steps=40))
    # The untrained model is near uniform over the vocabulary (log 1024 = 6.9); training learns the text.
    assert trained < untrained - 2.0, (untrained, trained)

    # The progress bar counts every step and shows the loss that step was trained on: the first step's is
    # the untrained model's, the last steps' are near what the trained model scores on the corpus.
    bar_states = re.split(r"[\r\n]", capsys.readouterr().err)
    reported = dict(re.findall(r"^Training: .*\| (\d+)/40 .*loss=([\d.]+)", "\n".join(bar_states), re.M))
    steps = [int(step) for step in reported]
    losses = [float(loss) for loss in reported.values()]
    assert steps == list(range(1, 41))
    assert abs(losses[0] - untrained) < 0.5, (losses[0], untrained)
    assert abs(statistics.mean(losses[-5:]) - trained) < 0.5, (losses[-5:], trained)


def test_a_student_trained_with_a_teacher_learns_the_teachers_distributions(tmp_path: Path) -> None:
    teacher = make_model("llama", "tiny", tmp_path / "teacher", train_steps=20)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    # Corpus text the training below also draws from: what is compared is the two models' outputs on it.
    ids = torch.tensor([tokenizer.encode(corpus_text(), add_special_tokens=False)[:512]])
    with torch.inference_mode():
        teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        teacher_logits = teacher_model(input_ids=ids).logits

    def divergence_and_agreement(folder: Path) -> tuple[float, float]:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            logits = model(input_ids=ids).logits
        kl = torch.nn.functional.kl_div(
            logits.log_softmax(-1)[0],
            teacher_logits.log_softmax(-1)[0],
            log_target=True,
            reduction="batchmean",
        )
        agreement = (logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()
        return float(kl), float(agreement)

    untrained = divergence_and_agreement(make_model("llama", "tiny", tmp_path / "untrained", seed=1))
    on_corpus = divergence_and_agreement(
        make_model("llama", "tiny", tmp_path / "corpus", seed=1, train_steps=40)
    )
    distilled = divergence_and_agreement(
        make_model("llama", "tiny", tmp_path / "distilled", seed=1, train_steps=40, teacher=teacher)
    )
    assert distilled[0] < on_corpus[0] and distilled[0] < untrained[0] / 2, (untrained, on_corpus, distilled)
    assert distilled[1] > on_corpus[1], (on_corpus, distilled)


def test_a_teacher_needs_training_steps_and_the_same_tokenizer(tmp_path: Path) -> None:
    teacher = make_model("qwen2", "tiny", tmp_path / "teacher")
    with pytest.raises(ValueError, match="give train_steps"):
        make_model("qwen2", "tiny", tmp_path / "a", teacher=teacher)
    with pytest.raises(ValueError, match="another tokenizer"):
        make_model("llama", "tiny", tmp_path / "b", train_steps=1, teacher=teacher)
