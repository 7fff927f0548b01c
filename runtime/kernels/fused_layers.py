"""How the model's layers bind their implementation when they are built: the C++ operations of
cpu_layers.cpp for float32 on the CPU, Triton's kernels on CUDA, their torch code otherwise.

A layer (`CustomOp`) is built for torch's default device and dtype, which the model loader sets, and binds
the implementation for them once; its calls never choose again. Choosing builds the C++ operations (or loads
them from the cache) the first time a layer asks for them, so an engine pays for it while it loads. Importing
this module loads no Triton: a layer bound to a Triton kernel imports its module when it runs, so CPU-only
processes never pay for (or depend on) Triton. KVFLEET_FUSED_KERNELS=0 binds the torch code everywhere, e.g.
to compare against it.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import logging
import os
from typing import Any

import torch
from kvfleet.runtime.kernels.cpu_build import CPU_LAYERS, build_cpu_ops
from torch import nn

logger = logging.getLogger(__name__)

ENV_VAR = "KVFLEET_FUSED_KERNELS"


class Implementation(enum.Enum):
    """What a layer runs; the value names the layer's method (`forward_<value>`)."""

    CPU = "cpu"  # the C++ operations of cpu_layers.cpp
    CUDA = "cuda"  # Triton's kernels
    NATIVE = "native"  # the layer's torch code


def _switched_on() -> bool:
    return os.environ.get(ENV_VAR, "1") != "0"


@functools.cache
def _kernels_available() -> bool:
    if not _switched_on():
        logger.info("fused layer kernels are off (%s=0)", ENV_VAR)
        return False
    if importlib.util.find_spec("triton") is None:
        logger.info("fused layer kernels are off: triton is not installed")
        return False
    return True


@functools.cache
def _cpu_ops_available() -> bool:
    return _switched_on() and build_cpu_ops(CPU_LAYERS)


def implementation_for(device: torch.device, dtype: torch.dtype) -> Implementation:
    """What layers whose activations have this device and dtype run: the C++ operations take float32 only."""
    if device.type == "cpu" and dtype == torch.float32 and _cpu_ops_available():
        return Implementation.CPU
    if device.type == "cuda" and _kernels_available():
        return Implementation.CUDA
    return Implementation.NATIVE


class CustomOp(nn.Module):
    """A layer with one method per implementation, `forward_cpu`, `forward_cuda` and `forward_native`, all
    taking the same arguments; the one for the device and dtype it is built under becomes its `forward`."""

    def __init__(self) -> None:
        super().__init__()
        self.implementation = implementation_for(torch.get_default_device(), torch.get_default_dtype())
        self.forward = getattr(self, f"forward_{self.implementation.value}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Straight to the bound implementation, past nn.Module's hook dispatch: these layers run several times
        # per decoder layer in every step, take no hooks, and at batch 1 that dispatch is a visible share.
        return self.forward(*args, **kwargs)
