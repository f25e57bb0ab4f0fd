"""Turn a device string from config ("cpu", "cuda:1", "npu:0") into a checked ``torch.device``.

Only these forms are accepted: ``cpu``, ``cuda``, ``cuda:N``, ``npu``, ``npu:N``.
A device that cannot be used here (no CUDA, no torch_npu, index out of range)
is a ValueError now, not a failure at the first copy.
"""

from __future__ import annotations

import re

import torch

_SPEC = re.compile(r"(cpu|cuda|npu)(?::(\d+))?")


def resolve_device(spec: str) -> torch.device:
    """Return the ``torch.device`` named by ``spec``, or raise ValueError saying why it cannot be used."""
    match = _SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"unknown device {spec!r}; expected cpu, cuda, cuda:N, npu or npu:N")
    kind, index_text = match.group(1), match.group(2)
    if kind == "cpu":
        if index_text is not None:
            raise ValueError(f"unknown device {spec!r}; use plain 'cpu'")
        return torch.device("cpu")
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401  (registers torch.npu)
        except ImportError as exc:
            raise ValueError(f"device {spec!r}: torch_npu is needed for npu devices but is not installed") from exc
    backend = getattr(torch, kind)
    if not backend.is_available():
        raise ValueError(f"device {spec!r}: {kind} is not available on this machine")
    if index_text is None:
        return torch.device(kind)
    index, count = int(index_text), backend.device_count()
    if index >= count:
        raise ValueError(f"device {spec!r}: index {index} out of range, this machine has {count} {kind} device(s)")
    return torch.device(kind, index)
