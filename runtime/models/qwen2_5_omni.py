"""Qwen2.5-Omni's thinker (`Qwen2_5OmniThinkerForConditionalGeneration`): a Qwen2.5-VL style vision
transformer (patches of two identical frames, 2-D rotary positions, attention within windows but on a few
layers over the whole image, and a merger of 2 x 2 patches into one embedding), a Whisper-style audio encoder
that attends within windows of the clip, and a Qwen2 language model with M-RoPE over the paged KV cache.

The language model rotates each token by three positions (time, row, column; see
`kvfleet.runtime.multimodal.mrope`), which the model runner hands it as a [3, tokens] tensor."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from kvfleet.runtime.attention.backend import AttentionBackend
from kvfleet.runtime.models.encoders import ConditionalGeneration
from kvfleet.runtime.models.layers import RMSNorm
from kvfleet.runtime.models.model_config import ModelConfig
from kvfleet.runtime.models.qwen2_audio import WHISPER_LAYER_NAMES, WhisperStyleEncoder
from torch import nn
from torch.nn import functional


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionBlock(nn.Module):
    """Pre-RMSNorm attention (queries and keys rotated by each patch's row and column) and a gated MLP."""

    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        width = int(vision["hidden_size"])
        inner = int(vision["intermediate_size"])
        self.num_heads = int(vision["num_heads"])
        self.norm1 = RMSNorm(width, 1e-6)
        self.norm2 = RMSNorm(width, 1e-6)
        self.attn = nn.ModuleDict({name: nn.Linear(width, width) for name in ("q", "k", "v", "proj")})
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(width, inner),
                "up_proj": nn.Linear(width, inner),
                "down_proj": nn.Linear(inner, width),
            }
        )
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"vision_config.hidden_act {vision['hidden_act']!r} is not supported (only silu)"
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[int] | None
    ) -> torch.Tensor:
        """x: [images, patches, width] in window order; windows: the patches of each window in turn, or None
        to attend over the whole image."""
        images, patches, width = x.shape
        normed = self.norm1(x)[0]
        q, k, v = (
            self.attn[name](normed).view(images, patches, self.num_heads, -1) for name in ("q", "k", "v")
        )
        # Rotated in float32, as the reference does.
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(v.dtype).transpose(1, 2)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(v.dtype).transpose(1, 2)
        v = v.transpose(1, 2)
        if windows is None:
            attended = functional.scaled_dot_product_attention(q, k, v)
        else:
            attended = torch.cat(
                [
                    functional.scaled_dot_product_attention(*parts)
                    for parts in zip(*(t.split(windows, dim=2) for t in (q, k, v)), strict=True)
                ],
                dim=2,
            )
        x = x + self.attn["proj"](attended.transpose(1, 2).reshape(images, patches, width))
        hidden = self.norm2(x)[0]
        gated = functional.silu(self.mlp["gate_proj"](hidden)) * self.mlp["up_proj"](hidden)
        return x + self.mlp["down_proj"](gated)


class VisionTransformer(nn.Module):
    def __init__(self, vision: dict[str, Any]) -> None:
        super().__init__()
        width = int(vision["hidden_size"])
        self.patch_size = int(vision.get("patch_size", 14))
        self.merge_size = int(vision.get("spatial_merge_size", 2))
        self.temporal_patch_size = int(vision.get("temporal_patch_size", 2))
        self.window_size = int(vision.get("window_size", 112))
        self.full_attention_blocks = frozenset(int(i) for i in vision.get("fullatt_block_indexes", ()))
        in_channels = int(vision.get("in_channels", 3))
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed = nn.ModuleDict(
            {"proj": nn.Conv3d(in_channels, width, kernel, stride=kernel, bias=False)}
        )
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(int(vision["depth"])))
        merged = width * self.merge_size**2
        self.merger = nn.ModuleDict(
            {
                "ln_q": RMSNorm(width, 1e-6),
                "mlp": nn.Sequential(
                    nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, int(vision["out_hidden_size"]))
                ),
            }
        )
        head_dim = width // int(vision["num_heads"])
        rope = vision.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))
        # A quarter of each head turns with the patch's row, the next quarter with its column (then repeated
        # for rotate-half's second half).
        spatial = head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2).float() / spatial), persistent=False
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [images, channels, height, width], all of one size (multiples of patch x merge) ->
        [images, merged patches, out hidden], merged patches in row-major order."""
        images, channels, height, width = pixels.shape
        p, m = self.patch_size, self.merge_size
        rows, cols = height // p, width // p
        # Patches in the processor's order: merge blocks row by row, the patches of a block row by row.
        patches = pixels.view(images, channels, rows // m, m, p, cols // m, m, p)
        patches = patches.permute(0, 2, 5, 3, 6, 1, 4, 7).reshape(images, rows * cols, channels * p * p)
        # A still image is its own frame twice over: the temporal kernel's slices add up.
        weight = self.patch_embed["proj"].weight.sum(dim=2).flatten(1)
        x = functional.linear(patches.to(weight.dtype), weight)

        order, windows = self._window_order(rows // m, cols // m, x.device)
        unit = m * m
        x = x.view(images, -1, unit, x.shape[-1])[:, order].flatten(1, 2)
        cos, sin = self._rotary(rows, cols, x.device)
        cos = cos.view(-1, unit, cos.shape[-1])[order].flatten(0, 1)[None, :, None, :]
        sin = sin.view(-1, unit, sin.shape[-1])[order].flatten(0, 1)[None, :, None, :]
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if index in self.full_attention_blocks else windows)
        merger = self.merger
        merged = merger["mlp"](merger["ln_q"](x)[0].reshape(images, -1, x.shape[-1] * unit))
        return merged[:, torch.argsort(order)]

    def _rotary(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's cos and sin [patches, head_dim], patches in the processor's order."""
        m = self.merge_size
        row_ids = torch.arange(rows, device=device)[:, None].expand(rows, cols)
        col_ids = torch.arange(cols, device=device)[None, :].expand(rows, cols)
        ids = [t.reshape(rows // m, m, cols // m, m).transpose(1, 2).flatten() for t in (row_ids, col_ids)]
        angles = torch.cat([ids[0][:, None] * self.inv_freq, ids[1][:, None] * self.inv_freq], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _window_order(self, rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """The merge blocks (rows x cols of them) reordered window by window (windows of window_size pixels,
        row-major, each row-major within), and each window's patch count."""
        side = self.window_size // self.merge_size // self.patch_size
        index = torch.arange(rows * cols, device=device).view(rows, cols)
        order, windows = [], []
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                window = index[top : top + side, left : left + side].flatten()
                order.append(window)
                windows.append(len(window) * self.merge_size**2)
        return torch.cat(order), windows


class AudioEncoder(WhisperStyleEncoder):
    """Whisper's convolutions and layers, run on windows of 2 x n_window mel frames of each clip (attention
    within a window), then average pooling by 2 over the clip, a norm and a projection."""

    def __init__(self, audio: dict[str, Any]) -> None:
        super().__init__(audio)
        width = int(audio["d_model"])
        self.window_frames = 2 * int(audio.get("n_window", 100))
        self.ln_post = nn.LayerNorm(width)
        self.proj = nn.Linear(width, int(audio["output_dim"]))
        # Whisper's fixed sinusoids over a window's positions (after the stride-2 convolution).
        positions = (self.window_frames - 1) // 2 + 1
        rates = torch.exp(-(math.log(10000.0) / (width // 2 - 1)) * torch.arange(width // 2).float())
        angles = torch.arange(int(audio.get("max_source_positions", 1500)))[:, None] * rates[None, :]
        self.register_buffer(
            "positional_embedding",
            torch.cat([angles.sin(), angles.cos()], dim=1)[:positions],
            persistent=False,
        )

    def forward(self, features: torch.Tensor, num_frames: list[int]) -> list[torch.Tensor]:
        """features: [clips, mel bins, frames]; num_frames: each clip's own frames -> each clip's
        embeddings [((frames - 1) // 2 + 1 - 2) // 2 + 1, output dim]."""
        window = self.window_frames
        chunks, lengths, owners = [], [], []
        for clip, (clip_features, frames) in enumerate(zip(features, num_frames, strict=True)):
            for start in range(0, frames, window):
                length = min(window, frames - start)
                chunk = clip_features[:, start : start + length]
                chunks.append(functional.pad(chunk, (0, window - length)))
                lengths.append(length)
                owners.append(clip)
        lengths_tensor = torch.tensor(lengths, device=features.device)
        frame_mask = torch.arange(window, device=features.device)[None, :] < lengths_tensor[:, None]
        x = functional.gelu(self.conv1(torch.stack(chunks))) * frame_mask[:, None, :]
        x = functional.gelu(self.conv2(x)).transpose(1, 2) + self.positional_embedding.to(x.dtype)
        kept = (lengths_tensor - 1) // 2 + 1
        key_mask = torch.arange(x.shape[1], device=x.device)[None, :] < kept[:, None]
        for layer in self.layers:
            x = layer(x, key_mask)
        per_clip: list[list[torch.Tensor]] = [[] for _ in num_frames]
        for chunk_output, count, clip in zip(x, kept.tolist(), owners, strict=True):
            per_clip[clip].append(chunk_output[:count])
        outputs = []
        for parts in per_clip:
            sequence = torch.cat(parts)
            pooled = (sequence.shape[0] - 2) // 2 + 1
            pairs = sequence[: 2 * pooled].view(pooled, 2, -1).mean(dim=1)
            outputs.append(self.proj(self.ln_post(pairs)))
        return outputs


class Qwen2_5OmniThinkerForConditionalGeneration(ConditionalGeneration):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, max_position: int) -> None:
        super().__init__(config, attention, max_position)
        multimodal = config.multimodal
        assert multimodal is not None
        if not config.uses_mrope:
            raise ValueError("Qwen2.5-Omni's text_config needs rope_parameters.mrope_section")
        self.visual = VisionTransformer(multimodal["vision_config"])
        self.audio_tower = AudioEncoder(multimodal["audio_config"])

    def embed_multimodal(
        self, modality: str, data: torch.Tensor, unpadded_lengths: torch.Tensor
    ) -> list[torch.Tensor]:
        """Images [images, 3, H, W] of one size, or clips' log-mel features [clips, mel bins, frames] and
        their own frames -> each item's embeddings [its tokens, hidden]."""
        dtype = self.audio_tower.proj.weight.dtype
        if modality == "image":
            return list(self.visual(data.to(dtype)))
        if modality == "audio":
            return self.audio_tower(data.to(dtype), unpadded_lengths.tolist())
        raise ValueError(f"Qwen2.5-Omni takes images and audio, not {modality}")

    def _language_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        encoder_tensor: Callable[[str, str, torch.Tensor], None],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The thinker's checkpoint keeps its language model at the top (`model.`, `lm_head.`), beside
        `visual.` and `audio_tower.`."""
        for hf_name, tensor in weights:
            if hf_name.startswith(("model.", "lm_head.")):
                yield hf_name, tensor
            else:
                encoder_tensor(hf_name, hf_name, tensor)

    def _encoder_parameter(self, name: str) -> str | None:
        if name.startswith("audio_tower.audio_bos_eos_token."):
            return None  # the talker's markers; the thinker never reads them
        if name.startswith("audio_tower.layers."):
            for whisper, ours in WHISPER_LAYER_NAMES.items():
                name = name.replace(f".{whisper}", f".{ours}")
        return name
