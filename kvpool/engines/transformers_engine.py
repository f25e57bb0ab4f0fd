"""PrefixCachedEngine: a HuggingFace causal LM whose prefix cache is kvpool (this worker's HBM, then the pool).

One request, greedy (:meth:`PrefixCachedEngine.generate`):

1. hash the prompt's full blocks (:meth:`KVCacheClient.block_keys`);
2. one lookup (HBM's leading run, then the pool's) of at most
   ``(len(prompt) - 1) // block_size`` blocks, so at least one token is always
   prefilled and its logits exist;
3. one ``get`` of the hit run straight into a staging tensor
   ``[n, layers, 2, block_size, kv_heads, head_dim]`` (each ``[i]`` is one
   block in the layout's ``layer_kv`` byte order); the model's cache wants
   ``[1, kv_heads, seq, head_dim]`` a layer, so each layer's prefix is copied
   once, permuted, straight into the tensor that also takes the suffix's K/V
   (the copy a plain cache makes anyway when it appends the suffix; before
   transformers 4.56, one permuting copy and then that append); a model on a
   GPU gets the staged blocks in one host-to-device copy first (staging is
   pinned there), and the permuting copy runs on the device; with
   ``layerwise=True`` the copy is issued layer by layer on a side stream,
   each layer's first use waiting on its own event only, so layer i+1's
   bytes cross while layer i computes (a GPU's copy engine beside its SMs);
4. a forward over the rest of the prompt only; the argmax of its last
   logits is the first token: the time to first token (TTFT) ends here;
5. the prompt's full blocks that were not loaded are put: a host cache's
   pieces are gathered straight into the blocks' targets (one copy, hashed
   as it goes, into slots the pool leased ahead where it has them:
   ``prepare_put``/``complete_put``), a device cache's are packed into host
   staging (one copy) and ``put``; HBM at once, the pool write-behind, never
   waited for;
6. decoding, one token a forward.

Invariants:
- Reuse is whole blocks of the leading hit run: ``reused + computed ==
  prompt length`` and ``reused`` is a multiple of ``block_size``.
- Only KV that a prefill computed is stored (never decode steps), and a
  loaded block is a byte copy of such KV for the same tokens under the same
  model (the key's namespace names model and layout): greedy output is the
  same whichever tier served the prefix, or none.
- A pool fault is a miss: the engine logs it and computes, never raises
  because of the pool. Without a client (``client=None``) the pool is off.
- One request at a time per engine (its staging buffer is reused); run one
  engine per thread or process.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpool.client.kvclient import KVCacheClient
from kvpool.client.lookup import LookupResult
from kvpool.client.tensors import host_array
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout
from kvpool.vocabulary import Tier

log = logging.getLogger(__name__)

KV_ORDER = "layer_kv"  # a block's bytes: layer 0 K, layer 0 V, layer 1 K, ...
TIERS = ("hbm", "dram", "ssd")


def kv_layout(model: Any, block_size: int) -> KVLayout:
    """The KV layout of ``model``'s cache in blocks of ``block_size`` tokens (full attention, K and V)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(dtype, config.num_hidden_layers, kv_heads, head_dim, block_size, KV_ORDER)


@dataclass(frozen=True)
class GenerationResult:
    """What one request did: tokens, where its prefix came from, and how long the first token took."""

    tokens: list[int]  # generated ids, greedy; tokens[0] came at ttft_s
    prompt_tokens: int
    reused: dict[str, int]  # prompt tokens loaded from each tier: hbm, dram, ssd (whole blocks)
    ttft_s: float  # request start to first token: hashing, lookup, loading, prefill of the rest
    total_s: float
    stored_blocks: int  # new full prompt blocks handed to the client (HBM now, pool write-behind)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: hash, lookup, load, assemble, prefill, store

    @property
    def reused_tokens(self) -> int:
        return sum(self.reused.values())

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the prefill computed."""
        return self.prompt_tokens - self.reused_tokens


class PrefixCachedEngine:
    """Greedy generation with a HuggingFace causal LM, its prefix cache in kvpool (see module docstring)."""

    def __init__(self, model: Any, client: KVCacheClient | None = None, *, layerwise: bool = False):
        self.model = model
        self.layerwise = layerwise  # a CUDA model: the loaded prefix crosses layer by layer (module docstring)
        self._copy_stream: Any = None
        self.client = client
        self.layout: KVLayout | None = None
        if client is not None:
            if client.layout is None:
                raise ValueError("the engine's client needs client.layout (see kv_layout(model, block_size))")
            want = kv_layout(model, client.layout.block_size)
            if client.layout != want:
                raise ValueError(f"client layout {client.layout.fingerprint()} is not the model's {want.fingerprint()}")
            self.layout = want
        params = inspect.signature(type(model).forward).parameters
        # transformers 5 calls the cache argument ``cache``; 4.x ``past_key_values``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._last_logits = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        self._blocks: torch.Tensor | None = None  # staging for loads and stores, [n, L, 2, B, H, D]
        self._pool_faults = 0

    # -- the request ---------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None = None) -> GenerationResult:
        """Greedy-generate up to ``max_new_tokens`` (>= 1) tokens after ``prompt_ids``, stopping after an EOS."""
        ids = [int(t) for t in prompt_ids]
        stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        keys: list[BlockKey] = []
        reused = dict.fromkeys(TIERS, 0)
        loaded = 0
        cache = None
        if self.client is not None:
            client, lay = self._pool()
            keys = self._pool_call("hash", timings, lambda: client.block_keys(ids)) or []
            usable = min(len(keys), (len(ids) - 1) // lay.block_size)  # leave a token to prefill
            result = self._pool_call("lookup", timings, lambda: client.lookup(keys[:usable])) if usable else None
            if result is not None and result.hit_blocks:
                loaded = self._pool_call("load", timings, lambda: self._load(keys, result)) or 0
                if loaded:
                    reused = _reused_by_tier(result, loaded, lay.block_size)
                    t = time.perf_counter()
                    cache = self._cache_from_blocks(loaded)
                    timings["assemble"] = time.perf_counter() - t
        if cache is None:
            cache = empty_cache()
        done = loaded * (self.layout.block_size if self.layout else 0)
        t = time.perf_counter()
        logits = self.forward(torch.tensor([ids[done:]]), cache)
        token = int(torch.argmax(logits))
        now = time.perf_counter()
        timings["prefill"] = now - t
        ttft = now - start
        stored = 0
        if self.client is not None and len(keys) > loaded:
            t = time.perf_counter()
            stored = self._store(keys, loaded, cache)
            timings["store"] = time.perf_counter() - t
        tokens = [token]
        while len(tokens) < max_new_tokens and token not in stop:
            token = int(torch.argmax(self.forward(torch.tensor([[token]]), cache)))
            tokens.append(token)
        return GenerationResult(tokens, len(ids), reused, ttft, time.perf_counter() - start, stored, timings)

    # -- model ---------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run ``input_ids`` ``[1, n]`` after what ``cache`` holds (which grows by n); the last position's logits."""
        kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._last_logits is not None:
            kwargs[self._last_logits] = 1
        out = self.model(input_ids=input_ids.to(self.model.device), **kwargs)
        return out.logits[0, -1]

    # -- pool ----------------------------------------------------------------------------------

    def _pool(self) -> tuple[KVCacheClient, KVLayout]:
        """The client and its layout (only an engine with a client has a layout: ``__init__`` sets both)."""
        assert self.client is not None and self.layout is not None, "transformers engine: no pool client"
        return self.client, self.layout

    def _pool_call(self, what: str, timings: dict[str, float], call: Any) -> Any:
        """Run one client call, timed; a fault of any kind is logged and becomes a miss (None)."""
        t = time.perf_counter()
        try:
            return call()
        except Exception:  # a pool fault is a cache miss, never an inference error
            self._pool_faults += 1
            log.warning("kvpool %s failed; computing instead", what, exc_info=self._pool_faults == 1)
            return None
        finally:
            timings[what] = time.perf_counter() - t

    def _staging(self, n: int) -> torch.Tensor:
        """``n`` blocks of host staging, ``[n, layers, 2, block, kv_heads, head_dim]``, grown when needed;
        page-locked when the model is on a CUDA device (its copies to and from the device use DMA)."""
        _, lay = self._pool()
        if self._blocks is None or self._blocks.shape[0] < n:
            shape = (n, lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
            pin = self.model.device.type == "cuda"
            self._blocks = torch.empty(shape, dtype=self.model.dtype, pin_memory=pin)
        return self._blocks[:n]

    def _load(self, keys: list[BlockKey], result: LookupResult) -> int:
        """Get the lookup's hit run into staging; how many leading blocks arrived."""
        n = result.hit_blocks
        client, _ = self._pool()
        staging = self._staging(n)
        return client.get(keys[:n], [staging[i] for i in range(n)], result)

    def _cache_from_blocks(self, n: int) -> Any:
        """The model's cache holding the first ``n`` staged blocks (read by the next forward: one request at a time)."""
        assert self._blocks is not None, "transformers engine: nothing staged"  # _load staged the blocks
        staging = self._blocks[:n]  # [n, L, 2, B, H, D]
        ready: list[Any] | None = None
        if self.layerwise and self.model.device.type == "cuda":
            staging, ready = self._to_device_by_layer(staging)
        elif staging.device != self.model.device:  # a GPU model: the blocks as they are, then permuted there
            staging = staging.to(self.model.device)
        cache = staged_cache(staging, ready)
        if cache is not None:
            return cache
        for wait in ready or ():  # older transformers: the whole prefix is read at once, after every layer landed
            wait()
        _, lay = self._pool()  # older transformers: one permuting copy of everything, then a plain cache
        kv = staging.permute(1, 2, 4, 0, 3, 5).contiguous()  # [L, 2, H, n, B, D]
        kv = kv.view(lay.num_layers, 2, 1, lay.num_kv_heads, n * lay.block_size, lay.head_dim)
        kv = kv.to(self.model.device)
        return prefilled_cache([(kv[layer, 0], kv[layer, 1]) for layer in range(lay.num_layers)])

    def _to_device_by_layer(self, staging: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Pinned ``staging`` copied to the model's device on a side stream, layer by layer: the device copy, and
        per layer a callable that makes the caller's stream wait for that layer's bytes (and no later layer's).

        Each copy is one block's contiguous piece of one layer (pinned to device memory: asynchronous). The
        forward reads layer i after waiting on event i only. The staging is reused by the next request only
        after this one's forward, which waited on every event.
        """
        device = self.model.device
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=device)
        out = torch.empty(staging.shape, dtype=staging.dtype, device=device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(device))  # out's allocation happened on the caller's stream
        events = []
        with torch.cuda.stream(stream):
            for layer in range(staging.shape[1]):
                for block in range(staging.shape[0]):
                    out[block, layer].copy_(staging[block, layer], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        out.record_stream(stream)
        return out, [lambda event=event: torch.cuda.current_stream(device).wait_event(event) for event in events]

    def _store(self, keys: list[BlockKey], loaded: int, cache: Any) -> int:
        """Put the prompt's full blocks after the loaded ones: one copy out of ``cache`` each (see
        :meth:`_store_on_host`; a device cache is packed into host staging first, then put)."""
        client, lay = self._pool()
        n = len(keys) - loaded
        first, last = loaded * lay.block_size, len(keys) * lay.block_size
        if all(t.device.type == "cpu" for layer in range(lay.num_layers) for t in layer_kv(cache, layer)):
            ok = self._pool_call("put", {}, lambda: self._store_on_host(client, keys[loaded:], first, cache))
            return n if ok is not None else 0
        staging = self._staging(n)
        for layer in range(lay.num_layers):
            for part, tensor in enumerate(layer_kv(cache, layer)):
                piece = tensor[0, :, first:last].reshape(lay.num_kv_heads, n, lay.block_size, lay.head_dim)
                staging[:, layer, part].copy_(piece.permute(1, 2, 0, 3))
        ok = self._pool_call("put", {}, lambda: client.put(keys[loaded:], [staging[i] for i in range(n)]))
        return n if ok is not None else 0

    def _store_on_host(self, client: KVCacheClient, keys: list[BlockKey], first: int, cache: Any) -> list[bool]:
        """Each block's pieces (per layer K then V, ``[block, kv_heads, head_dim]`` each: the staging layout)
        gathered straight from the host cache into the block's target, a slot the pool leased ahead where it has
        one, hashed in the same pass (:meth:`KVCacheClient.prepare_put`)."""
        _, lay = self._pool()
        kv = [host_array(t[0]) for layer in range(lay.num_layers) for t in layer_kv(cache, layer)]  # [H, seq, D]
        prepared = client.prepare_put(keys)
        for b in range(len(keys)):
            at = first + b * lay.block_size
            prepared.fill(b, [t[:, at : at + lay.block_size].transpose(1, 0, 2) for t in kv])
        return client.complete_put(prepared)


def _reused_by_tier(result: LookupResult, loaded: int, block_size: int) -> dict[str, int]:
    """Tokens of the ``loaded`` leading blocks per tier the lookup found them in."""
    hbm = min(loaded, result.hbm_blocks)
    pool = [loc.tier for loc in result.pool[: loaded - hbm]]
    return {
        "hbm": hbm * block_size,
        "dram": sum(t == Tier.DRAM for t in pool) * block_size,
        "ssd": sum(t == Tier.SSD for t in pool) * block_size,
    }


# -- transformers' cache, across versions ------------------------------------------------------


def empty_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def prefilled_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A DynamicCache holding ``pairs`` (per layer K, V ``[1, heads, seq, dim]``), without copying them again.

    transformers >= 4.56 keeps per-layer objects whose first ``update`` would
    concatenate onto an empty tensor (a copy): we hand them the tensors.
    Older versions store the first update's tensors as they are.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    seq = pairs[0][0].shape[-2] if pairs else 0
    layers = getattr(cache, "layers", None)
    if layers is not None and not layers:
        try:
            from transformers.cache_utils import DynamicLayer

            for k, v in pairs:
                layer = DynamicLayer()
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                layers.append(layer)
            if cache.get_seq_length() == seq:
                return cache
        except (ImportError, TypeError, AttributeError):
            pass
        cache = DynamicCache()
    for i, (k, v) in enumerate(pairs):
        cache.update(k, v, i)
    assert cache.get_seq_length() == seq, "engine: the cache does not hold the loaded prefix"
    return cache


@functools.cache
def _staged_layer_class() -> type | None:
    """A transformers ``DynamicLayer`` whose prefix still lies in block staging (None: no such class here)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class StagedLayer(DynamicLayer):
        """Until its first ``update``, the layer's K and V are ``[n, block, heads, dim]`` block views.

        The first update writes those (permuted) and the new states into one
        ``[1, heads, n * block + new, dim]`` tensor each: one copy, where a
        plain DynamicLayer would concatenate a prefix it had copied before.
        """

        def __init__(self, k_blocks: torch.Tensor, v_blocks: torch.Tensor, ready: Any = None):
            super().__init__()
            self._staged: tuple[torch.Tensor, torch.Tensor] | None = (k_blocks, v_blocks)
            self._ready = ready  # called once before the staged blocks are first read (a layer-wise copy's wait)
            self._staged_len = k_blocks.shape[0] * k_blocks.shape[1]
            self.device = k_blocks.device
            self.keys = k_blocks.new_empty(0)
            self.values = v_blocks.new_empty(0)
            self.is_initialized = True

        def get_seq_length(self) -> int:
            return self._staged_len if self._staged is not None else super().get_seq_length()

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self._staged is None:
                return super().update(key_states, value_states, *args, **kwargs)
            if self._ready is not None:
                self._ready()
                self._ready = None
            merged = []
            for blocks, new in zip(self._staged, (key_states, value_states)):
                n, block, heads, dim = blocks.shape
                batch, _, extra, _ = new.shape
                assert batch == 1 and new.shape[1] == heads and new.shape[3] == dim, "engine: K/V shape mismatch"
                out = new.new_empty(1, heads, n * block + extra, dim)
                out[:, :, : n * block].view(1, heads, n, block, dim).copy_(blocks.permute(2, 0, 1, 3).unsqueeze(0))
                out[:, :, n * block :].copy_(new)
                merged.append(out)
            self._staged = None
            self.keys, self.values = merged
            return self.keys, self.values

    return StagedLayer


def staged_cache(staging: torch.Tensor, ready: Sequence[Any] | None = None) -> Any:
    """A DynamicCache over block staging ``[n, layers, 2, block, heads, dim]``; None if this transformers lacks layers.

    The staging must stay untouched until the next forward has run. ``ready[i]`` (optional) is called once,
    just before layer i's staged blocks are first read (a layer-wise copy's wait for that layer).
    """
    from transformers import DynamicCache

    layer_class = _staged_layer_class()
    cache = DynamicCache()
    layers = getattr(cache, "layers", None)
    if layer_class is None or layers is None or layers:
        return None
    try:
        for layer in range(staging.shape[1]):
            layers.append(layer_class(staging[:, layer, 0], staging[:, layer, 1],
                                      ready[layer] if ready is not None else None))
        if cache.get_seq_length() == staging.shape[0] * staging.shape[3]:
            return cache
    except (TypeError, AttributeError):  # a transformers whose layers work otherwise
        pass
    return None


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V ``[1, heads, seq, dim]`` in a DynamicCache (any version)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]
