from kvpool.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "tiers", "dram_max_block_bytes", "max_block_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAM_MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    dram_max_block_bytes: int
    max_block_bytes: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., dram_max_block_bytes: _Optional[int] = ..., max_block_bytes: _Optional[int] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("incarnation", "heartbeat_interval_s", "node_timeout_s", "max_keys_per_call")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    NODE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    heartbeat_interval_s: float
    node_timeout_s: float
    max_keys_per_call: int
    def __init__(self, incarnation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., node_timeout_s: _Optional[float] = ..., max_keys_per_call: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "tiers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ReportBlocksRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "tier", "full_sync", "added_keys", "added_sizes", "added_checksums", "removed_keys", "sync_complete")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    ADDED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ADDED_SIZES_FIELD_NUMBER: _ClassVar[int]
    ADDED_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SYNC_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    tier: _common_pb2.Tier
    full_sync: bool
    added_keys: bytes
    added_sizes: _containers.RepeatedScalarFieldContainer[int]
    added_checksums: _containers.RepeatedScalarFieldContainer[int]
    removed_keys: bytes
    sync_complete: bool
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., full_sync: _Optional[bool] = ..., added_keys: _Optional[bytes] = ..., added_sizes: _Optional[_Iterable[int]] = ..., added_checksums: _Optional[_Iterable[int]] = ..., removed_keys: _Optional[bytes] = ..., sync_complete: _Optional[bool] = ...) -> None: ...

class ReportBlocksResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class UnregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "incarnation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class UnregisterNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "worker_id", "hbm_prefix_blocks", "block_tokens", "counted_by_caller")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HBM_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COUNTED_BY_CALLER_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    worker_id: str
    hbm_prefix_blocks: int
    block_tokens: int
    counted_by_caller: bool
    def __init__(self, keys: _Optional[bytes] = ..., worker_id: _Optional[str] = ..., hbm_prefix_blocks: _Optional[int] = ..., block_tokens: _Optional[int] = ..., counted_by_caller: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("tiers", "node_indexes", "sizes", "checksums", "nodes", "dram_blocks", "ssd_blocks")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEXES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tiers: bytes
    node_indexes: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeRef]
    dram_blocks: int
    ssd_blocks: int
    def __init__(self, tiers: _Optional[bytes] = ..., node_indexes: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeRef, _Mapping]]] = ..., dram_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("keys", "worker_ids")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[bytes] = ..., worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker_id", "hbm_blocks", "dram_blocks", "ssd_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hbm_blocks: int
    dram_blocks: int
    ssd_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., hbm_blocks: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("workers", "pool_dram_blocks", "pool_ssd_blocks")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POOL_DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    pool_dram_blocks: int
    pool_ssd_blocks: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ..., pool_dram_blocks: _Optional[int] = ..., pool_ssd_blocks: _Optional[int] = ...) -> None: ...

class NameBlocksRequest(_message.Message):
    __slots__ = ("keys", "engine_hashes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_HASHES_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    engine_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[bytes] = ..., engine_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class NameBlocksResponse(_message.Message):
    __slots__ = ("named",)
    NAMED_FIELD_NUMBER: _ClassVar[int]
    named: int
    def __init__(self, named: _Optional[int] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: bytes
    def __init__(self, present: _Optional[bytes] = ...) -> None: ...

class PlaceBlocksRequest(_message.Message):
    __slots__ = ("keys", "sizes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[bytes] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PlaceBlocksResponse(_message.Message):
    __slots__ = ("node_indexes", "present", "nodes", "too_large")
    NODE_INDEXES_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    node_indexes: _containers.RepeatedScalarFieldContainer[int]
    present: bytes
    nodes: _containers.RepeatedCompositeFieldContainer[_common_pb2.NodeRef]
    too_large: bytes
    def __init__(self, node_indexes: _Optional[_Iterable[int]] = ..., present: _Optional[bytes] = ..., nodes: _Optional[_Iterable[_Union[_common_pb2.NodeRef, _Mapping]]] = ..., too_large: _Optional[bytes] = ...) -> None: ...

class ReportHbmRequest(_message.Message):
    __slots__ = ("worker_id", "added_keys", "removed_keys", "full_sync")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    added_keys: bytes
    removed_keys: bytes
    full_sync: bool
    def __init__(self, worker_id: _Optional[str] = ..., added_keys: _Optional[bytes] = ..., removed_keys: _Optional[bytes] = ..., full_sync: _Optional[bool] = ...) -> None: ...

class ReportHbmResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportLookupsRequest(_message.Message):
    __slots__ = ("worker_id", "block_tokens", "lookups", "requested_blocks", "hbm_blocks", "dram_blocks", "ssd_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    block_tokens: int
    lookups: int
    requested_blocks: int
    hbm_blocks: int
    dram_blocks: int
    ssd_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., block_tokens: _Optional[int] = ..., lookups: _Optional[int] = ..., requested_blocks: _Optional[int] = ..., hbm_blocks: _Optional[int] = ..., dram_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ...) -> None: ...

class ReportLookupsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "tiers", "seconds_since_heartbeat", "incarnation", "dram_max_block_bytes", "max_block_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DRAM_MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    seconds_since_heartbeat: float
    incarnation: int
    dram_max_block_bytes: int
    max_block_bytes: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., seconds_since_heartbeat: _Optional[float] = ..., incarnation: _Optional[int] = ..., dram_max_block_bytes: _Optional[int] = ..., max_block_bytes: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("nodes", "indexed_blocks", "workers", "hbm_blocks", "lookups", "requested_blocks", "hit_blocks_hbm", "hit_blocks_dram", "hit_blocks_ssd", "blocks_too_large", "largest_refused_bytes", "largest_block_bytes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HBM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_HBM_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_DRAM_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_SSD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    LARGEST_REFUSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    indexed_blocks: int
    workers: int
    hbm_blocks: int
    lookups: int
    requested_blocks: int
    hit_blocks_hbm: int
    hit_blocks_dram: int
    hit_blocks_ssd: int
    blocks_too_large: int
    largest_refused_bytes: int
    largest_block_bytes: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., indexed_blocks: _Optional[int] = ..., workers: _Optional[int] = ..., hbm_blocks: _Optional[int] = ..., lookups: _Optional[int] = ..., requested_blocks: _Optional[int] = ..., hit_blocks_hbm: _Optional[int] = ..., hit_blocks_dram: _Optional[int] = ..., hit_blocks_ssd: _Optional[int] = ..., blocks_too_large: _Optional[int] = ..., largest_refused_bytes: _Optional[int] = ..., largest_block_bytes: _Optional[int] = ...) -> None: ...

class MasterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MasterInfoResponse(_message.Message):
    __slots__ = ("call_port", "version", "tenant_mask", "standby", "leader_address", "cluster", "kv_events_server_key", "max_keys_per_call", "shard", "shard_count")
    CALL_PORT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_MASK_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_SERVER_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    call_port: int
    version: str
    tenant_mask: bytes
    standby: bool
    leader_address: str
    cluster: str
    kv_events_server_key: str
    max_keys_per_call: int
    shard: int
    shard_count: int
    def __init__(self, call_port: _Optional[int] = ..., version: _Optional[str] = ..., tenant_mask: _Optional[bytes] = ..., standby: _Optional[bool] = ..., leader_address: _Optional[str] = ..., cluster: _Optional[str] = ..., kv_events_server_key: _Optional[str] = ..., max_keys_per_call: _Optional[int] = ..., shard: _Optional[int] = ..., shard_count: _Optional[int] = ...) -> None: ...

class FollowedNode(_message.Message):
    __slots__ = ("node", "number", "incarnation", "tiers", "dram_max_block_bytes", "max_block_bytes")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DRAM_MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    node: _common_pb2.NodeRef
    number: int
    incarnation: int
    tiers: _containers.RepeatedCompositeFieldContainer[_common_pb2.TierUsage]
    dram_max_block_bytes: int
    max_block_bytes: int
    def __init__(self, node: _Optional[_Union[_common_pb2.NodeRef, _Mapping]] = ..., number: _Optional[int] = ..., incarnation: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[_common_pb2.TierUsage, _Mapping]]] = ..., dram_max_block_bytes: _Optional[int] = ..., max_block_bytes: _Optional[int] = ...) -> None: ...

class FollowedBlocks(_message.Message):
    __slots__ = ("number", "tier", "full_sync", "added_keys", "added_sizes", "added_checksums", "removed_keys")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    ADDED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ADDED_SIZES_FIELD_NUMBER: _ClassVar[int]
    ADDED_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    number: int
    tier: _common_pb2.Tier
    full_sync: bool
    added_keys: bytes
    added_sizes: _containers.RepeatedScalarFieldContainer[int]
    added_checksums: _containers.RepeatedScalarFieldContainer[int]
    removed_keys: bytes
    def __init__(self, number: _Optional[int] = ..., tier: _Optional[_Union[_common_pb2.Tier, str]] = ..., full_sync: _Optional[bool] = ..., added_keys: _Optional[bytes] = ..., added_sizes: _Optional[_Iterable[int]] = ..., added_checksums: _Optional[_Iterable[int]] = ..., removed_keys: _Optional[bytes] = ...) -> None: ...

class IndexChange(_message.Message):
    __slots__ = ("seq", "joined", "left", "blocks")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    joined: FollowedNode
    left: str
    blocks: FollowedBlocks
    def __init__(self, seq: _Optional[int] = ..., joined: _Optional[_Union[FollowedNode, _Mapping]] = ..., left: _Optional[str] = ..., blocks: _Optional[_Union[FollowedBlocks, _Mapping]] = ...) -> None: ...

class FollowRequest(_message.Message):
    __slots__ = ("log_id", "after_seq")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    log_id: int
    after_seq: int
    def __init__(self, log_id: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class FollowResponse(_message.Message):
    __slots__ = ("log_id", "behind", "changes")
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    log_id: int
    behind: bool
    changes: _containers.RepeatedCompositeFieldContainer[IndexChange]
    def __init__(self, log_id: _Optional[int] = ..., behind: _Optional[bool] = ..., changes: _Optional[_Iterable[_Union[IndexChange, _Mapping]]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("snapshot_id", "offset")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    offset: int
    def __init__(self, snapshot_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("snapshot_id", "log_id", "seq", "nodes", "total", "locations", "offset")
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    snapshot_id: int
    log_id: int
    seq: int
    nodes: _containers.RepeatedCompositeFieldContainer[FollowedNode]
    total: int
    locations: bytes
    offset: int
    def __init__(self, snapshot_id: _Optional[int] = ..., log_id: _Optional[int] = ..., seq: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[FollowedNode, _Mapping]]] = ..., total: _Optional[int] = ..., locations: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...
