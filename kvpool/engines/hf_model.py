"""HuggingFace models for the reference engine: a seeded random Qwen2 (no download) or a local directory.

Invariants:
- :func:`random_qwen2` builds the same weights in every process for the same
  ``seed`` and :class:`ModelSize` (same torch and transformers versions): two
  workers built this way compute the same KV, so they may share pool blocks.
  It does not disturb the caller's global RNG.
- :func:`load_local` never touches the network (``local_files_only``).
- :func:`model_id` names the weights, not just the architecture: it goes into
  every block key's namespace, so two models never share blocks.
- :class:`ByteTokenizer` is a deterministic stand-in for models without a
  tokenizer: one token per UTF-8 byte (ids 0-255).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

ATTN_IMPLEMENTATION = "sdpa"  # used for every model we build, so all engines compute alike
# A directory without one of these has no tokenizer (transformers 5 would build an empty one).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True)
class ModelSize:
    """Dimensions of a random Qwen2."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1408
    vocab: int = 32000
    max_positions: int = 8192
    init_std: float = 0.3  # transformers' default (0.02) makes a random model repeat one token forever


SIZES: dict[str, ModelSize] = {
    # hidden 512, 8 layers, 2 KV heads of 64: one 128-token block of fp32 KV is 1 MiB.
    "small": ModelSize(),
    # for tests on a small CI box: one 16-token block is 4 KiB.
    "tiny": ModelSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, max_positions=4096),
}


class Tokenizer(Protocol):
    """What the demo needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 (a random model may emit them) decode to U+FFFD."""

    name = "byte-level (one token per UTF-8 byte; the model has no tokenizer)"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        parts, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                parts += [run.decode("utf-8", "replace"), "\ufffd"]
                run = bytearray()
        parts.append(run.decode("utf-8", "replace"))
        return "".join(parts)


class HfTokenizer:
    """A transformers tokenizer behind the :class:`Tokenizer` protocol (no special tokens added)."""

    def __init__(self, tokenizer: Any, name: str):
        self._tok = tokenizer
        self.name = name

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def random_qwen2(size: ModelSize | str = "small", seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A ``Qwen2ForCausalLM`` with seeded random weights, in eval mode, without gradients."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}")
        size = SIZES[size]
    config = Qwen2Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        max_position_embeddings=size.max_positions, tie_word_embeddings=True, use_sliding_window=False,
        initializer_range=size.init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION, **_dtype_kwarg(dtype))
    model.config.kvpool_seed = seed  # part of model_id: other seeds are other weights
    return _ready(model)


def load_local(path: str, dtype: torch.dtype | None = None) -> tuple[Any, Tokenizer]:
    """A causal LM and its tokenizer from a local directory (no download); ByteTokenizer if it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path):
        raise ValueError(f"--model {path}: not a directory")
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION,
        **_dtype_kwarg(dtype if dtype is not None else "auto"),
    )
    tokenizer: Tokenizer = ByteTokenizer()
    if any(os.path.exists(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        try:
            tokenizer = HfTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True),
                                    f"{os.path.basename(os.path.abspath(path))}'s own")
        except (OSError, ValueError):
            pass
    model.config.kvpool_weights = _weights_signature(path)
    return _ready(model), tokenizer


def _weights_signature(path: str) -> str:
    """Names and sizes of a directory's weight files: two fine-tunes of one config differ here."""
    entries = sorted(
        f"{name}:{os.path.getsize(os.path.join(path, name))}"
        for name in os.listdir(path) if name.endswith((".safetensors", ".bin", ".pt", ".gguf"))
    )
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _dtype_kwarg(dtype: Any) -> dict[str, Any]:
    """transformers >= 4.56 calls it ``dtype``; older versions ``torch_dtype``."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _ready(model: Any) -> Any:
    model.eval()
    model.requires_grad_(False)
    return model


def model_id(model: Any) -> str:
    """A name for these weights: the directory's name (or model type), then a hash of the config.

    The hash covers the seed of a random model and, for a local directory, the
    names and sizes of its weight files. Set ``client.model`` to name a model
    explicitly instead.
    """
    config = model.config
    fields = config.to_dict()
    for where in ("_name_or_path", "transformers_version"):  # the same weights elsewhere or under a newer version
        fields.pop(where, None)
    text = json.dumps(fields, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = os.path.basename(str(getattr(config, "_name_or_path", "") or "").rstrip("/")) or config.model_type
    seed = getattr(config, "kvpool_seed", None)
    return f"{name}-random-seed{seed}-{digest}" if seed is not None else f"{name}-{digest}"
