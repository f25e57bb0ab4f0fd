from kvpool.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("keys", "sizes", "data", "checksums")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: bytes
    def __init__(self, stored: _Optional[bytes] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("tiers", "sizes", "checksums", "data")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tiers: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, tiers: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class BulkGetReply(_message.Message):
    __slots__ = ("tiers", "sizes", "checksums")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    tiers: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tiers: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class BulkGetTrailer(_message.Message):
    __slots__ = ("valid",)
    VALID_FIELD_NUMBER: _ClassVar[int]
    valid: bytes
    def __init__(self, valid: _Optional[bytes] = ...) -> None: ...

class BulkPutRequest(_message.Message):
    __slots__ = ("keys", "sizes", "checksums")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class NodeExistsResponse(_message.Message):
    __slots__ = ("tiers",)
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tiers: bytes
    def __init__(self, tiers: _Optional[bytes] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("keys", "promote")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    promote: bool
    def __init__(self, keys: _Optional[bytes] = ..., promote: _Optional[bool] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("arena", "slots", "slot_gens", "sizes", "checksums")
    ARENA_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_GENS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    arena: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    slot_gens: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, arena: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., slot_gens: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("node", "tiers", "dram_max_block_bytes", "max_keys_per_call")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAM_MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    dram_max_block_bytes: int
    max_keys_per_call: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., dram_max_block_bytes: _Optional[int] = ..., max_keys_per_call: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("keys", "sizes", "lease")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    lease: int
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ..., lease: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("arena", "lease", "slots", "slot_gens", "already_held", "lease_timeout_s")
    ARENA_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_GENS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_HELD_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    arena: str
    lease: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    slot_gens: _containers.RepeatedScalarFieldContainer[int]
    already_held: bytes
    lease_timeout_s: float
    def __init__(self, arena: _Optional[str] = ..., lease: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., slot_gens: _Optional[_Iterable[int]] = ..., already_held: _Optional[bytes] = ..., lease_timeout_s: _Optional[float] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease", "keys", "slots", "checksums", "next_sizes", "keep_lease")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SIZES_FIELD_NUMBER: _ClassVar[int]
    KEEP_LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    keys: bytes
    slots: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    next_sizes: _containers.RepeatedScalarFieldContainer[int]
    keep_lease: bool
    def __init__(self, lease: _Optional[int] = ..., keys: _Optional[bytes] = ..., slots: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., next_sizes: _Optional[_Iterable[int]] = ..., keep_lease: _Optional[bool] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored", "next")
    STORED_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    stored: bytes
    next: ReserveResponse
    def __init__(self, stored: _Optional[bytes] = ..., next: _Optional[_Union[ReserveResponse, _Mapping]] = ...) -> None: ...

class FlushReportsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushReportsResponse(_message.Message):
    __slots__ = ("indexed",)
    INDEXED_FIELD_NUMBER: _ClassVar[int]
    indexed: bool
    def __init__(self, indexed: _Optional[bool] = ...) -> None: ...
