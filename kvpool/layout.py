"""KV layouts: what one cache block holds, how many bytes it is, and which buffers fit it.

A block is the K and V (or, for MLA models, the one latent) tensor of
``block_size`` tokens across all layers, each piece shaped
``[block_size, num_kv_heads, head_dim]``. ``kv_order`` says how the pieces
follow each other in the block's bytes:

- ``layer_kv``: layer 0 K, layer 0 V, layer 1 K, ... (MindIE's ``[layers][2]``)
- ``kv_layer``: all layers' K, then all layers' V
- ``latent``:  one piece per layer (DeepSeek MLA)

Invariant: :func:`check_block` is the one gate for "is this one block?",
called by every part that takes blocks from an engine (the HBM tier, the
client's get and put, the engine adapters). It accepts a buffer, a tensor or
a byte count only if its byte length is exactly :attr:`KVLayout.block_bytes`,
a tensor only if contiguous, and anything carrying a dtype only if that dtype
is the layout's (or raw bytes). Anything else is a ValueError naming what was
wrong: never a silent copy or cast.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

from kvpool.buffers import BufferLike, byte_view

# dtype name -> bytes per element. Names follow torch (torch.bfloat16 -> "bfloat16").
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
KV_ORDERS = ("layer_kv", "kv_layer", "latent")


@runtime_checkable
class TensorLike(Protocol):
    """What :func:`check_block` reads of a tensor (torch's, on any device; torch is never imported here)."""

    @property
    def dtype(self) -> Any: ...

    def is_contiguous(self) -> bool: ...

    def numel(self) -> int: ...

    def element_size(self) -> int: ...


Block = int | BufferLike | TensorLike  # what check_block takes: a byte count, a buffer or a tensor


def canonical_dtype(name: str) -> str:
    """Normalise a dtype name (``torch.bfloat16``, ``bf16``, ``bfloat16``) or raise ValueError."""
    short = str(name).removeprefix("torch.").lower()
    short = _DTYPE_ALIASES.get(short, short)
    if short not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return short


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one KV cache block (see module docstring)."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_order: str = "layer_kv"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KV layout {name} must be a positive integer, got {value!r}")
        if self.kv_order not in KV_ORDERS:
            raise ValueError(f"unknown kv_order {self.kv_order!r}; known: {', '.join(KV_ORDERS)}")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_parts(self) -> int:
        """2 (K and V) or 1 (an MLA latent)."""
        return 1 if self.kv_order == "latent" else 2

    @property
    def piece_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K (or V, or latent) for one block."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def piece_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_pieces(self) -> int:
        return self.num_layers * self.kv_parts

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers."""
        return self.num_pieces * self.piece_bytes

    def piece_offset(self, layer: int, part: int) -> int:
        """Byte offset of ``layer``'s K (part 0) or V (part 1) inside a block."""
        if not 0 <= layer < self.num_layers or not 0 <= part < self.kv_parts:
            raise ValueError(f"no piece (layer={layer}, part={part}) in {self.fingerprint()}")
        if self.kv_order == "kv_layer":
            index = part * self.num_layers + layer
        else:
            index = layer * self.kv_parts + part
        return index * self.piece_bytes

    def fingerprint(self) -> str:
        """A short stable string naming this layout; part of every key's namespace."""
        return (
            f"{self.dtype}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{self.kv_order}"
        )

    def check_block(self, block: Block, *, what: str = "buffer") -> None:
        """ValueError unless ``block`` is exactly one block of this layout (:func:`check_block`)."""
        check_block(block, self.block_bytes, self.dtype, what=what, layout=self.fingerprint())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVLayout:
        """Build a layout from config; unknown or missing fields are a ValueError."""
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"unknown KV layout field(s): {', '.join(sorted(unknown))}")
        missing = {"dtype", "num_layers", "num_kv_heads", "head_dim", "block_size"} - set(data)
        if missing:
            raise ValueError(f"KV layout is missing: {', '.join(sorted(missing))}")
        return cls(**data)


def check_block(block: Block, block_bytes: int, dtype: str | None = None, *, what: str = "buffer",
                layout: str = "") -> None:
    """ValueError unless ``block`` is exactly one block of ``block_bytes`` bytes (the module's one gate).

    ``block`` is one of:

    - a tensor (anything with ``is_contiguous``, ``numel`` and ``element_size``: torch, on any device): it must be
      contiguous;
    - a buffer (the buffer protocol: numpy, bytes, memoryview): it must be C-contiguous;
    - an ``int``: the byte count of a block an engine names by pieces (addresses and sizes).

    With ``dtype`` (a layout's :func:`canonical_dtype`), a ``block`` carrying a dtype must carry that one or
    ``uint8`` (raw bytes). ``what`` names the block in the message (``"page 3"``); ``layout`` names whose block
    size it is (a fingerprint; empty: none). Checks only: no copy, no view kept.
    """
    whose = f"one block of {layout}" if layout else "one block"
    if isinstance(block, bool):
        raise ValueError(f"{what} is {block!r}, not a block")
    if isinstance(block, int):
        nbytes = block
    else:
        found = getattr(block, "dtype", None)
        if dtype is not None and found is not None:
            name = str(found).removeprefix("torch.")
            if name not in ("uint8", dtype):
                raise ValueError(f"{what} dtype {name} does not match layout dtype {dtype}")
        if isinstance(block, TensorLike):
            if not block.is_contiguous():
                raise ValueError(f"{what} must be contiguous")
            nbytes = block.numel() * block.element_size()
        else:
            nbytes = byte_view(block).nbytes
    if nbytes != block_bytes:
        raise ValueError(f"{what} is {nbytes} bytes; {whose} is {block_bytes}")
