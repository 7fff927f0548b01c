"""Training a made model's weights on the corpus, alone or from a teacher model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfleet.runtime.models.make_model.tokenizer import corpus_text

# Training: windows of this many tokens, this many per step, Adam at this rate after a linear warm-up.
_TRAIN_WINDOW = 128
_TRAIN_BATCH = 8
_TRAIN_LEARNING_RATE = 3e-3
_TRAIN_WARMUP_STEPS = 20


def load_teacher(teacher: Path, student: Path) -> Any:
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


def train(folder: Path, tokenizer: Any, steps: int, seed: int, teacher: Any | None) -> None:
    """Train the folder's weights for `steps` steps on the corpus and write them back in their dtype: toward
    the corpus's next tokens, or toward the teacher's next-token distributions when a teacher is given."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from tqdm import tqdm
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
    # A step takes long enough for every one to be shown, with the loss it was trained on.
    progress = tqdm(range(steps), desc="Training", unit="step", mininterval=0, miniters=1, dynamic_ncols=True)
    for _ in progress:
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
        progress.set_postfix(loss=f"{loss.item():.4f}", refresh=False)  # shown as the step counts
    dtype = getattr(torch, model.config.dtype) if isinstance(model.config.dtype, str) else model.config.dtype
    weights = folder / "model.safetensors"
    tensors = {name: tensor.detach().to(dtype).contiguous() for name, tensor in model.state_dict().items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)
