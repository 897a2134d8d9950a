#!/usr/bin/env bash
# Regenerates the gRPC stubs of the admin API (api/proto/admin.proto) into
# src/layerstack/_pb/ with grpcio-tools; the output is committed.
# tests/test_stubs.py fails when the committed stubs are stale against the proto.
# usage: clients/python/generate.sh   (needs `pip install grpcio-tools`; set
# PYTHON to pick the interpreter, default python3)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROTO_DIR="$(cd "$HERE/../../api/proto" && pwd)"
OUT="$HERE/src"
PY="${PYTHON:-python3}"
# The virtual include path makes the generated modules import each other as
# `layerstack._pb.admin_pb2` (a plain -I would give a top-level `import admin_pb2`).
"$PY" -m grpc_tools.protoc \
    "-Ilayerstack/_pb=$PROTO_DIR" \
    --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
    layerstack/_pb/admin.proto
echo "generate.sh: wrote $(cd "$OUT/layerstack/_pb" && ls admin_pb2*.py* | tr '\n' ' ')"
