"""Host byte views of engine tensors, so the pool (numpy, buffers) never needs to know about devices.

- A CPU tensor or any buffer: a flat uint8 view of its own memory (no copy).
- A device tensor (cuda, npu): a host staging buffer (:func:`host_bytes`:
  page-locked where torch can pin); for reads, ``finish`` copies the staging
  bytes into the device tensor.
torch is imported only if the caller already uses it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool.buffers import as_array


def is_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _check_contiguous(tensor: Any) -> None:
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")


def host_bytes(nbytes: int) -> Any:
    """A host uint8 tensor of ``nbytes``, page-locked if this torch has an accelerator to pin for.

    Tries the factory's ``pin_memory=True``, then ``Tensor.pin_memory()`` (what MindIE itself
    calls for its host KV cache under torch_npu); a CPU-only torch refuses both: plain memory.
    """
    import torch

    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        pass
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    try:
        return buffer.pin_memory()
    except RuntimeError:  # CPU-only torch: no pinned allocator
        return buffer


def read_target(obj: Any) -> tuple[np.ndarray, Callable[[], None] | None]:
    """A writable host view to fill, and a ``finish`` to call after filling it (None: nothing to do)."""
    if not is_tensor(obj):
        return as_array(obj, writable=True), None
    import torch

    _check_contiguous(obj)
    flat = obj.view(-1).view(torch.uint8)
    if obj.device.type == "cpu":
        return flat.numpy(), None
    staging = host_bytes(flat.numel())
    return staging.numpy(), lambda: flat.copy_(staging)


def write_source(obj: Any) -> np.ndarray:
    """A host uint8 view (or copy, for device tensors) of the bytes to store."""
    if not is_tensor(obj):
        return as_array(obj)
    import torch

    _check_contiguous(obj)
    flat = obj.detach().view(-1).view(torch.uint8)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


_SAME_SIZE_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def host_array(tensor: Any) -> np.ndarray:
    """A host tensor's memory as numpy (no copy): its shape and strides, as integers of its element size (numpy
    has no bfloat16; only the bytes matter to the pool). ValueError for a device tensor."""
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"a tensor on {tensor.device} has no host memory to view")
    return tensor.detach().view(getattr(torch, _SAME_SIZE_INTS[tensor.element_size()])).numpy()


def as_tensor(obj: Any) -> Any:
    """A torch view of a buffer or tensor (for the HBM tier), sharing memory where it can."""
    if is_tensor(obj):
        return obj
    import torch

    arr = as_array(obj)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())
