"""KVCacheClient's get and put refuse a block that is not one block of the client's layout, by the layout's one
check (:meth:`kvpool.layout.KVLayout.check_block`), before anything is read, queued or stored. No servers: the
refusal comes before any pool call (the master address is never dialled)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

from kvpool.client.kvclient import KVCacheClient
from kvpool.config import ClientConfig
from kvpool.keys import BlockKey
from kvpool.layout import KVLayout

LAYOUT = KVLayout("bfloat16", 2, 2, 8, 4)  # 512-byte blocks
KEYS = [BlockKey(bytes([i]) * 32) for i in range(2)]


@pytest.fixture(params=[0, 2], ids=["pool_only", "with_hbm"])
def client(request):
    c = KVCacheClient(ClientConfig(master="127.0.0.1:1", layout=LAYOUT, hbm_blocks=request.param))
    yield c
    c.close()


def good() -> torch.Tensor:
    return torch.zeros(LAYOUT.block_bytes // 2, dtype=torch.bfloat16)


BAD = {
    "short_tensor": (lambda: torch.zeros(LAYOUT.block_bytes // 2 - 1, dtype=torch.bfloat16),
                     f"1 is {LAYOUT.block_bytes - 2} bytes; one block of {LAYOUT.fingerprint()} is 512"),
    "wrong_dtype": (lambda: torch.zeros(LAYOUT.block_bytes // 4, dtype=torch.float32),
                    "1 dtype float32 does not match layout dtype bfloat16"),
    "long_buffer": (lambda: np.zeros(LAYOUT.block_bytes + 1, np.uint8),
                    f"1 is {LAYOUT.block_bytes + 1} bytes; one block of"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_put_refuses_a_wrong_block_whole(client: KVCacheClient, case: str) -> None:
    make, message = BAD[case]
    with pytest.raises(ValueError, match=re.escape(f"block {message}")):
        client.put(KEYS, [good(), make()])
    if client.hbm is not None:
        assert client.hbm.keys() == []  # the good block before it was not stored either


@pytest.mark.parametrize("case", sorted(BAD))
def test_get_refuses_a_wrong_output_whole(client: KVCacheClient, case: str) -> None:
    make, message = BAD[case]
    out = good()
    with pytest.raises(ValueError, match=re.escape(f"output {message}")):
        client.get(KEYS, [out, make()])
    assert not out.view(torch.uint8).any()
