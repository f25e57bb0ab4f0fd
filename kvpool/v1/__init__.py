"""The kvpool.v1 wire contract: code generated from ``proto/kvpool/v1/*.proto``.

Regenerate with ``python -m kvpool.protogen`` (needs grpcio-tools, pinned in
the ``test`` extra); ``tests/unit/test_proto.py`` fails if these files drift.
"""
