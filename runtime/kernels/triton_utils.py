"""What every kernel launcher needs to know about how Triton will run it."""

from __future__ import annotations

import torch
import triton
from triton.runtime import interpreter


def _install_interpreter_scalar_fix() -> None:
    """Let Triton 3.6's interpreter use loaded scalars as loop bounds under numpy >= 2.4.

    The interpreter holds a scalar as a one-element array and converts it with int(array), which numpy 2.4
    turned into a TypeError; so every loop whose bound is read from memory fails. Later Triton releases
    squeeze the array first, which is what this does, and only in the interpreter.
    """
    original = interpreter._patch_lang_tensor
    if getattr(original, "kvfleet_scalar_fix", False):
        return

    def patch_lang_tensor(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.kvfleet_scalar_fix = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


_install_interpreter_scalar_fix()


def is_interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (TRITON_INTERPRET=1) instead of compiling."""
    return bool(triton.knobs.runtime.interpret)


def upcast_bf16_dots(dtype: torch.dtype) -> bool:
    """Whether matrix products must be done on float32 copies of the operands.

    Triton's interpreter stores bfloat16 as raw 16-bit integers and its `tl.dot` multiplies those bit
    patterns as integers, so bfloat16 products are wrong there; compiled kernels keep bfloat16 operands.
    """
    return dtype == torch.bfloat16 and is_interpreting()


def check_device(*tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter runs on CPU tensors."""
    for tensor in tensors:
        if not tensor.is_cuda and not is_interpreting():
            raise ValueError(
                f"Triton kernels need CUDA tensors, got one on {tensor.device} "
                "(set TRITON_INTERPRET=1 before importing the kernels to run them on the CPU)"
            )


def torch_dtype_is_supported(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16, torch.float32)
