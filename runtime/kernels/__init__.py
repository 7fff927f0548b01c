"""kvfleet's Triton kernels: paged attention, KV cache writes, fused layer ops and batched LoRA.

Each kernel module imports Triton at import time; `torch_reference` holds the plain torch version of every
kernel and imports only torch, so that CPU-only code paths never load Triton.
"""
