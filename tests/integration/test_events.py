"""Issue 16, the event stream: kvpool's KV events on a real ZMQ PUB socket with replay, in vLLM's format.

Subscribers are real pyzmq sockets (SUB for the stream, DEALER for replay, as vLLM's own subscriber
example does); the format is checked by vLLM's own decoder (``vllm.distributed.kv_events``, in
build/vllm-venv).
"""

from __future__ import annotations

import json
import subprocess
import threading

import msgspec
import numpy as np
import pytest
import zmq
from event_support import Collector, MediaModel
from prometheus_client import CollectorRegistry
from support import wait_until

from kvpool.event_publisher import EventLimits, EventPublisher
from kvpool.events import (
    END_SEQ,
    MAX_BATCH_BYTES,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    KVEventBatch,
    key_hash,
    removed,
    stored,
)
from kvpool.vocabulary import Tier

DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)


@pytest.fixture
def publisher():
    registry = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kvpool", registry=registry)
    pub.registry = registry
    yield pub
    pub.close()


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def subscribe(ctx: zmq.Context, pub: EventPublisher) -> zmq.Socket:
    """A SUB socket that is known to be receiving: a PUB drops what it sends before a subscription reaches
    it, so publish probes (AllBlocksCleared) until one arrives, then drain the rest."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvpool")
    sub.setsockopt(zmq.RCVTIMEO, 100)
    sub.connect(pub.endpoint)

    def joined() -> bool:
        pub.publish([AllBlocksCleared()])
        try:
            sub.recv_multipart()
            return True
        except zmq.Again:
            return False

    wait_until(joined, timeout=10, interval=0)
    while True:
        try:
            sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    return sub


def receive(sub: zmq.Socket) -> tuple[int, KVEventBatch]:
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kvpool"
    return int.from_bytes(seq, "big"), DECODE.decode(payload)


def replay(ctx: zmq.Context, endpoint: str | None, start: int,
           topic: bytes = b"kvpool") -> list[tuple[int, bytes]]:
    """(seq, payload) of every buffered batch from ``start`` on, each on ``topic``, through a DEALER as vLLM's
    subscriber example asks."""
    assert endpoint is not None
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    topic_wanted = topic
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got: list[tuple[int, bytes]] = []
        while True:
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return got
            assert topic == topic_wanted
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_a_subscriber_sees_every_batch_in_order_with_no_gap(publisher, ctx):
    sub = subscribe(ctx, publisher)
    first = None
    for i in range(200):
        seq = publisher.publish([stored([bytes([i]) * 32], MEDIUM_CPU, 4096), removed([bytes([i]) * 32], MEDIUM_CPU)])
        assert seq is not None
        first = seq if first is None else first
    seen = [receive(sub) for _ in range(200)]
    assert [s for s, _ in seen] == list(range(first, first + 200))
    for i, (_, batch) in enumerate(seen):
        stored_event, removed_event = batch.events
        assert stored_event.block_hashes == [bytes([i]) * 32] and stored_event.medium == MEDIUM_CPU
        assert stored_event.block_size == 4096 and removed_event.block_hashes == [bytes([i]) * 32]
    wait_until(lambda: publisher.registry.get_sample_value("kvpool_events_published_total") >= first + 200)
    assert publisher.registry.get_sample_value("kvpool_event_subscribers") == 1


def test_a_late_subscriber_recovers_the_missed_range_through_replay(publisher, ctx):
    early = [publisher.publish([stored([bytes([i]) * 32], MEDIUM_STORAGE)]) for i in range(30)]
    assert early == list(range(30))
    sub = subscribe(ctx, publisher)  # its probes are 30, 31, ...: it sees a gap from 0
    seq = publisher.publish([removed([b"x" * 32], MEDIUM_GPU)])
    got_seq, batch = receive(sub)
    assert got_seq == seq and batch.events[0].medium == MEDIUM_GPU
    missed = replay(ctx, publisher.replay_endpoint, 0)
    assert [s for s, _ in missed] == list(range(seq + 1))  # everything from 0, in order, up to the newest
    for i, (_, payload) in enumerate(missed[:30]):
        assert DECODE.decode(payload).events[0].block_hashes == [bytes([i]) * 32]
    assert replay(ctx, publisher.replay_endpoint, seq + 1) == []  # nothing newer: just the end marker
    assert publisher.registry.get_sample_value("kvpool_events_replayed_total") == seq + 1


def test_the_replay_buffer_keeps_the_newest_batches(ctx):
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kvpool",
                         limits=EventLimits(buffer_batches=10), registry=CollectorRegistry())
    try:
        for i in range(25):
            pub.publish([stored([bytes([i]) * 32], MEDIUM_CPU)])
        wait_until(lambda: [s for s, _ in replay(ctx, pub.replay_endpoint, 0)] == list(range(15, 25)), timeout=10)
    finally:
        pub.close()


def test_a_stuck_publisher_thread_drops_new_batches_without_blocking_and_the_gap_shows(ctx):
    registry = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kvpool",
                         limits=EventLimits(max_queue=5), registry=registry)
    release, entered = threading.Event(), threading.Event()
    send = pub._send

    def slow_send(*batch):  # stands for a publisher thread that cannot keep up
        entered.set()
        release.wait(30)
        return send(*batch)

    try:
        sub = subscribe(ctx, pub)
        pub._send = slow_send
        results = [pub.publish([stored([bytes([0]) * 32], MEDIUM_CPU)])]
        assert entered.wait(10)  # the thread holds that batch, stuck: from here on only the queue takes more
        results += [pub.publish([stored([bytes([i]) * 32], MEDIUM_CPU)]) for i in range(1, 40)]
        accepted = [r for r in results if r is not None]
        dropped = results.count(None)
        # The thread holds one batch, the queue five: everything past those is dropped, at once.
        assert len(accepted) == 6 and dropped == 34
        assert registry.get_sample_value("kvpool_events_dropped_total") == dropped
        after = pub.publish([removed([b"z" * 32], MEDIUM_CPU)])
        assert after is None  # still stuck: still dropped, still numbered
        release.set()
        seen = [receive(sub)[0] for _ in accepted]
        assert seen == accepted  # in order; the dropped numbers are the gap
        nxt = pub.publish([removed([b"z" * 32], MEDIUM_CPU)])
        assert nxt is not None and receive(sub)[0] == nxt and nxt == accepted[-1] + dropped + 2
    finally:
        release.set()
        pub.close()


def test_a_malformed_replay_request_is_ignored_and_the_stream_goes_on(publisher, ctx):
    assert publisher.replay_endpoint is not None
    bad = ctx.socket(zmq.DEALER)
    bad.connect(publisher.replay_endpoint)
    bad.send_multipart([b"", b"\x01\x02"])  # a 2-byte sequence
    bad.send_multipart([b"no delimiter"])
    sub = subscribe(ctx, publisher)
    seq = publisher.publish([stored([b"k" * 32], MEDIUM_CPU)])
    assert receive(sub)[0] == seq
    assert [s for s, _ in replay(ctx, publisher.replay_endpoint, seq)] == [seq]
    bad.close(linger=0)


def test_a_second_publisher_on_the_same_port_is_refused_clearly(publisher):
    with pytest.raises(ValueError, match="cannot bind"):
        EventPublisher(publisher.endpoint, registry=CollectorRegistry())


def test_junk_half_sent_frames_and_idle_connections_on_both_ports_change_nothing(publisher, ctx):
    """Raw TCP peers that send garbage, stop mid-handshake, or never speak: the stream and replay go on for a
    real subscriber, in order, and the publisher's thread survives."""
    import socket

    peers = []
    for endpoint in (publisher.endpoint, publisher.replay_endpoint):
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        for junk in (b"", b"\xff" + b"\x00" * 8 + b"\x7f", b"GET / HTTP/1.1\r\n\r\n" * 50, b"\xff\x00\x00"):
            peer = socket.create_connection((host, int(port)), timeout=5)
            if junk:
                peer.sendall(junk)
            peers.append(peer)
    try:
        sub = subscribe(ctx, publisher)
        seqs = [publisher.publish([stored([bytes([i]) * 32], MEDIUM_CPU)]) for i in range(50)]
        assert [receive(sub)[0] for _ in range(50)] == seqs
        assert [s for s, _ in replay(ctx, publisher.replay_endpoint, seqs[0])] == seqs
    finally:
        for peer in peers:
            peer.close()


def test_tenant_topics_never_prefix_one_another():
    from kvpool.events import escape_tenant, tenant_prefix

    assert tenant_prefix("kvpool", "") == "kvpool/"  # auth off: the topics as they always were
    assert tenant_prefix("kvpool", "a") == "kvpool/a/"
    assert escape_tenant("x/y%2Fz") == "x%2Fy%252Fz"
    names = ["a", "a/b", "a%2Fb", "ab", "a%", "%", "/"]
    prefixes = [tenant_prefix("kvpool", n) for n in names]
    assert len(set(prefixes)) == len(names)
    assert not any(p != q and q.startswith(p) for p in prefixes for q in prefixes)


def test_the_feed_sends_each_tenants_blocks_to_that_tenant_only_named_as_it_names_them(tmp_path):
    """Issue 26, the master's feed with an auth file: pool changes are split by their keys' tags, a worker's
    HBM changes go to its scoped id's tenant (a key of another tenant under it is counted, never sent), and
    every block is named by its engine name or the tenant's own key, in the tenant's own sequence."""
    import secrets

    from kvpool.auth import Authority, mask_keys
    from kvpool.event_guard import EventAccess
    from kvpool.keys import opaque_key
    from kvpool.master.engine_names import EngineNames
    from kvpool.master.index import BlockIndex
    from kvpool.master.kv_events import MasterEventFeed, Tenants
    from kvpool.worker_ids import scoped_id

    authority = Authority(secrets.token_bytes(32), [], {secrets.token_hex(16): ("a", 0),
                                                         secrets.token_hex(16): ("b/2", 0)})
    registry = CollectorRegistry()
    publisher = EventPublisher("tcp://127.0.0.1:0", topic="kvpool", registry=registry,
                               access=EventAccess.from_authority(authority))
    published: list[tuple[str, str, list]] = []
    real_publish = publisher.publish
    publisher.publish = lambda events, topic=None, tenant="": published.append((tenant, topic, list(events)))
    try:
        names = EngineNames(tenants=authority.tenants)
        feed = MasterEventFeed(publisher, "kvpool", names, Tenants.of(authority))
        assert sorted(published) == [("a", "kvpool/a/pool", [AllBlocksCleared()]),
                                     ("b/2", "kvpool/b%2F2/pool", [AllBlocksCleared()])]
        published.clear()
        index = BlockIndex(min_capacity=64, on_change=feed.pool_changed, tags=True)
        index.open_node(0)
        a_keys = [opaque_key(f"feed-a-{i}") for i in range(3)]
        b_keys = [opaque_key(f"feed-b-{i}") for i in range(2)]
        a_stored = [mask_keys(k, authority.mask("a")) for k in a_keys]
        b_stored = [mask_keys(k, authority.mask("b/2")) for k in b_keys]
        words = np.frombuffer(b"".join(a_stored[:1]), np.uint64).reshape(-1, 4)
        names.learn(words[:, 0].copy(), words[:, 1].copy(), np.array([77], np.uint64), index.holds, "a")
        stored_keys = a_stored + b_stored
        index.add(0, Tier.DRAM, stored_keys, [1] * 5, [0] * 5)
        by_tenant = {tenant: (topic, sorted(h for e in events for h in e.block_hashes))
                     for tenant, topic, events in published}
        assert by_tenant == {"a": ("kvpool/a/pool", sorted([77, key_hash(a_keys[1]), key_hash(a_keys[2])])),
                             "b/2": ("kvpool/b%2F2/pool", sorted(map(key_hash, b_keys)))}
        published.clear()
        feed.hbm_changed(scoped_id("a", "w1"), [a_stored[1], b_stored[0]], [])
        assert [(t, topic, [h for e in events for h in e.block_hashes]) for t, topic, events in published] == [
            ("a", "kvpool/a/hbm/w1", [key_hash(a_keys[1])])]
        assert registry.get_sample_value("kvpool_events_refused_total", {"what": "tenant"}) == 1
        published.clear()
        publisher.publish = real_publish  # one sequence per tenant
        assert [publisher.publish([AllBlocksCleared()], "kvpool/a/pool", "a") for _ in range(3)] == [0, 1, 2]
        assert publisher.publish([AllBlocksCleared()], "kvpool/b%2F2/pool", "b/2") == 0
    finally:
        publisher.close()


def test_a_master_whose_events_port_is_taken_refuses_to_start_and_says_which(tmp_path):
    import grpc
    from support import free_port

    from kvpool.config import MasterConfig
    from kvpool.master.server import MasterServer
    from kvpool.v1 import master_pb2, master_pb2_grpc

    holder = EventPublisher(f"tcp://127.0.0.1:{free_port()}", registry=CollectorRegistry())
    try:
        server = MasterServer(MasterConfig.of(host="127.0.0.1", port=0, metrics_port=0,
                                           kv_events_endpoint=holder.endpoint))
        with pytest.raises(ValueError, match=f"KV events: cannot bind {holder.endpoint}"):
            server.start()
        assert server.events is None and server.port != 0
        with pytest.raises(grpc.RpcError):  # the gRPC port it had bound was released: nothing answers there
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                master_pb2_grpc.MasterStub(channel).Info(master_pb2.MasterInfoRequest(), timeout=1)
    finally:
        holder.close()


def test_vllms_own_decoder_reads_kvpools_batches(publisher):
    """The format check that matters: vllm.distributed.kv_events.KVEventBatch decodes what kvpool sends."""
    from vllm_runtime import vllm_python

    python = vllm_python()
    assert python is not None, "no vLLM here: run `bash tests/vllm_env.sh` (tests/run.sh does)"
    batch = KVEventBatch(ts=123.5, events=[stored([b"a" * 32, b"b" * 32], MEDIUM_CPU, 4096, parent=b"p" * 32),
                                          removed([b"a" * 32], MEDIUM_STORAGE), AllBlocksCleared()])
    payload = msgspec.msgpack.encode(batch)
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared\n"
        "b = msgspec.msgpack.Decoder(type=KVEventBatch).decode(bytes.fromhex(sys.stdin.read()))\n"
        "out = {'ts': b.ts, 'events': [[type(e).__name__, [h.hex() for h in getattr(e, 'block_hashes', [])],\n"
        "        getattr(e, 'medium', None), getattr(e, 'block_size', None),\n"
        "        (e.parent_block_hash.hex() if getattr(e, 'parent_block_hash', None) else None)] for e in b.events]}\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([python, "-c", script], input=payload.hex(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    assert decoded == {"ts": 123.5, "events": [
        ["BlockStored", [(b"a" * 32).hex(), (b"b" * 32).hex()], "CPU", 4096, (b"p" * 32).hex()],
        ["BlockRemoved", [(b"a" * 32).hex()], "STORAGE", None, None],
        ["AllBlocksCleared", [], None, None, None]]}


def test_a_subscriber_that_never_reads_slows_no_one(ctx):
    """It loses batches past its high-water mark; the publisher drops nothing, and a reading subscriber gets
    every batch, from the stream or, where it fell behind the mark too, from replay."""
    registry = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kvpool",
                         limits=EventLimits(subscriber_bytes=200 * MAX_BATCH_BYTES), registry=registry)
    try:
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        stuck.connect(pub.endpoint)
        reader = subscribe(ctx, pub)
        wait_until(lambda: registry.get_sample_value("kvpool_event_subscribers") == 2, timeout=10)
        sent = [pub.publish([stored([i.to_bytes(32, "big")], MEDIUM_CPU)]) for i in range(3000)]
        assert None not in sent
        got: dict[int, KVEventBatch] = {}
        reader.setsockopt(zmq.RCVTIMEO, 1000)
        while sent[-1] not in got:
            try:
                seq, batch = receive(reader)
            except zmq.Again:
                break
            got[seq] = batch
        missing = [s for s in sent if s not in got]
        for seq, payload in replay(ctx, pub.replay_endpoint, missing[0]) if missing else []:
            got.setdefault(seq, DECODE.decode(payload))
        assert [got[s].events[0].block_hashes for s in sent] == [[i.to_bytes(32, "big")] for i in range(3000)]
        assert registry.get_sample_value("kvpool_events_dropped_total") == 0
        stuck.setsockopt(zmq.RCVTIMEO, 100)
        held = 0
        while True:
            try:
                stuck.recv_multipart()
                held += 1
            except zmq.Again:
                break
        assert held < 3000  # it lost batches at its mark, and nothing waited for it
        print(f"the stuck subscriber kept {held} of 3000; the reader missed {len(missing)} and replayed them")
        stuck.close(linger=0)
    finally:
        pub.close()


def test_a_replay_to_a_requester_that_does_not_keep_up_arrives_whole_and_in_order(ctx):
    """ZMQ's ROUTER drops what passes a peer's send mark without a word. The replay port sends with
    ROUTER_MANDATORY, a few batches at a time: a requester that does not read while the replay goes on
    (6 MB: more than the kernel's socket buffers) holds it back instead of losing batches, and then gets all
    3,000, in order, and the end marker."""
    registry = CollectorRegistry()
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kvpool",
                         limits=EventLimits(buffer_batches=3000), registry=registry)
    try:
        chain = [j.to_bytes(32, "big") for j in range(64)]
        sent = [pub.publish([stored(chain, MEDIUM_CPU, parent=i.to_bytes(32, "big"))]) for i in range(3000)]
        wait_until(lambda: registry.get_sample_value("kvpool_events_published_total") == 3000, timeout=30)
        assert pub.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, 10)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        wait_until(lambda: registry.get_sample_value("kvpool_events_replayed_total") >= 100, timeout=30)
        got = []
        while (frames := dealer.recv_multipart())[2] != END_SEQ:
            got.append(int.from_bytes(frames[2], "big"))
        assert got == sent
        assert registry.get_sample_value("kvpool_events_replayed_total") == 3000
        dealer.close(linger=0)
    finally:
        pub.close()


# -- the master's feed, end to end: a real `kvpool serve` -----------------------------------------------


def test_a_subscriber_of_kvpool_serve_sees_every_tier_change_in_order_and_replays_what_it_missed(tmp_path):
    """Puts fill DRAM (stored CPU), evictions demote to SSD (removed CPU, stored STORAGE), a full SSD drops its
    oldest (removed STORAGE), a get of an SSD block promotes it (stored CPU). The stream, the part the late
    subscriber missed replayed, has no gap, every event is a real transition, and the model it builds agrees
    with the node's tier counts and with what lookups find."""
    from support import PoolProcesses, free_port, metric, scrape

    from kvpool.client.kvclient import KVCacheClient
    from kvpool.config import ClientConfig
    from kvpool.keys import opaque_key

    procs = PoolProcesses(tmp_path, **{"dram-bytes": "4M", "ssd-bytes": "4M", "max-block-bytes": "1M"})
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = None
    try:
        procs.serve(**{"master-kv-events-endpoint": pub, "master-kv-events-replay-endpoint": rep})
        ks = [opaque_key(f"events-{i}") for i in range(20)]
        rng = np.random.default_rng(3)
        values = [rng.integers(0, 256, 512 << 10, dtype=np.uint8) for _ in ks]  # 10 MiB: twice DRAM + SSD
        with KVCacheClient(ClientConfig(master=procs.master, lookup_timeout_s=2.0, io_timeout_s=5.0)) as c:
            assert c.put(ks[:3], values[:3]) == [True] * 3 and c.flush(timeout=10)
            wait_until(lambda: c.lookup(ks[:3]).hit_blocks == 3)
            sub = Collector(ctx, pub, b"kvpool/")  # joins late: the first batches reach it only by replay
            wait_until(lambda: metric(scrape(procs.master_metrics_port), "kvpool_event_subscribers") == 1)
            for i in range(3, len(ks)):  # one by one: DRAM holds about 7, SSD as many
                assert c.put([ks[i]], [values[i]]) == [True] and c.flush(timeout=10)
            on_ssd = [k for k in ks if (r := c.lookup([k])).hit_blocks == 1 and r.ssd_blocks == 1]
            assert on_ssd, "test setup: nothing was demoted to SSD"
            out = [np.zeros_like(values[0])]
            assert c.get([on_ssd[-1]], out) == 1 and np.array_equal(out[0], values[ks.index(on_ssd[-1])])

            def settled() -> bool:
                model = MediaModel()
                for _, _, batch in stream():
                    model.apply(batch)
                node = procs.status().nodes[0]
                counts = {t.tier: t.blocks for t in node.tiers}
                return (model.holding(MEDIUM_CPU), model.holding(MEDIUM_STORAGE)) == (counts.get(1), counts.get(2))

            def stream():
                first = sub.got[0][1] if sub.got else 0
                missed = [(b"kvpool/pool", seq, DECODE.decode(p)) for seq, p in replay(ctx, rep, 0, b"kvpool/pool")]
                return missed[:first] + list(sub.got) if first else list(sub.got)

            wait_until(settled, timeout=20)
            batches = stream()
            seqs = [seq for _, seq, _ in batches]
            assert seqs == list(range(len(seqs))), "a gap or a reordering in the sequence"
            assert sub.got[0][1] > 0, "the subscriber joined late: the replay must have supplied the first batches"
            assert isinstance(batches[0][2].events[0], AllBlocksCleared)  # a fresh master starts from empty
            model = MediaModel()
            for topic, _, batch in batches:
                assert topic == b"kvpool/pool"
                model.apply(batch)
            kinds = {(kind, medium) for kind, medium, _ in model.seen}
            assert kinds == {("BlockStored", MEDIUM_CPU), ("BlockRemoved", MEDIUM_CPU),
                             ("BlockStored", MEDIUM_STORAGE), ("BlockRemoved", MEDIUM_STORAGE)}, kinds
            promoted = key_hash(on_ssd[-1])
            cpu_stores = [i for i, (kind, medium, h) in enumerate(model.seen)
                          if h == promoted and (kind, medium) == ("BlockStored", MEDIUM_CPU)]
            assert len(cpu_stores) == 2, "the promoted block is stored in CPU a second time"
            for key in ks:  # the events' view is the index's: best medium = the tier lookups serve from
                held = model.media.get(key_hash(key), set())
                r = c.lookup([key])
                want = (0, 0, 0) if not held else (1, 1, 0) if MEDIUM_CPU in held else (1, 0, 1)
                assert (r.hit_blocks, r.dram_blocks, r.ssd_blocks) == want, (key_hash(key), held, r)
    finally:
        if sub is not None:
            sub.close()
        ctx.term()
        procs.close()
    procs.assert_stopped_cleanly()
