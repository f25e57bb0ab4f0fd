"""Engine adapters: the interfaces inference engines call, each backed by kvpool's client.

One module per engine (MindIE's MemPool backend, vllm-ascend's store backend,
a HuggingFace transformers reference engine). They hold no pool logic of
their own: keys, lookups and data movement are :mod:`kvpool.client`'s.
"""
