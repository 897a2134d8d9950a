"""The committed stubs (src/layerstack/_pb) match api/proto/admin.proto.

Compares descriptors, not bytes, so another grpcio-tools version cannot make it
fail: the proto is compiled again (grpc_tools.protoc) into a FileDescriptorSet
and its file descriptor must equal the one the committed admin_pb2 carries; every
RPC of the service must be on the committed stub. When the installed
grpcio-tools is the pinned one (pyproject.toml), the regenerated files must also
equal the committed ones byte for byte. Fix: clients/python/generate.sh.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from layerstack._pb import admin_pb2, admin_pb2_grpc

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
PROTO_DIR = PKG.parent.parent / "api" / "proto"
PB_DIR = PKG / "src" / "layerstack" / "_pb"
FIX = "stale stubs: run clients/python/generate.sh and commit src/layerstack/_pb"


def _protoc(*args: str) -> None:
    pytest.importorskip("grpc_tools", reason="pip install grpcio-tools (the [test] extra)")
    p = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-Ilayerstack/_pb={PROTO_DIR}", *args, "layerstack/_pb/admin.proto"],
        capture_output=True,
    )
    assert p.returncode == 0, p.stderr.decode()


def test_the_committed_descriptor_is_the_protos() -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "admin.pb"
        _protoc(f"--descriptor_set_out={out}")
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto()
    admin_pb2.DESCRIPTOR.CopyToProto(committed)
    # The embedded descriptor has no source info and no json_name (protoc's
    # Python generator drops both); everything else must be equal.
    fresh.ClearField("source_code_info")
    for f in (fresh, committed):
        _clear_json_names(f.message_type)
    assert committed == fresh, FIX


def _clear_json_names(messages) -> None:  # type: ignore[no-untyped-def]
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        _clear_json_names(m.nested_type)


def test_the_committed_stub_has_every_rpc() -> None:
    service = admin_pb2.DESCRIPTOR.services_by_name["Admin"]
    stub_src = (PB_DIR / "admin_pb2_grpc.py").read_text()
    for m in service.methods:
        assert f"/layerstack.admin.v1.Admin/{m.name}" in stub_src, f"{m.name}: {FIX}"
    assert hasattr(admin_pb2_grpc, "AdminStub")


def test_the_committed_files_are_what_the_pinned_generator_writes() -> None:
    tools = pytest.importorskip("grpc_tools")
    from importlib.metadata import version

    pyproject = (PKG / "pyproject.toml").read_text()
    pinned = pyproject.split('grpcio-tools==', 1)[1].split('"', 1)[0]
    if version("grpcio-tools") != pinned:
        pytest.skip(f"grpcio-tools {version('grpcio-tools')} is not the pinned {pinned}")
    assert tools is not None
    with tempfile.TemporaryDirectory() as d:
        _protoc(f"--python_out={d}", f"--pyi_out={d}", f"--grpc_python_out={d}")
        for name in ("admin_pb2.py", "admin_pb2.pyi", "admin_pb2_grpc.py"):
            fresh = (Path(d) / "layerstack" / "_pb" / name).read_bytes()
            assert fresh == (PB_DIR / name).read_bytes(), f"{name}: {FIX}"
