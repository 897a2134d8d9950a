#!/usr/bin/env python3
"""P10's driver (bench/src/scenarios/p10_cluster.rs): a checkpoint made
runnable on a second worker, and rollouts on one and on two Ray worker nodes.

The caller (the Rust scenario) starts Debian's ``docker-registry`` on
127.0.0.1 (its access log in ``--registry-log``) and three daemons with empty
stores, no containerd, the registry named insecure: ``--a`` and ``--b`` (the
two workers), ``--coordinator``. This script imports a busybox base
(``ImportBase``) and measures, from Python over the admin API:

1. **Runnable elsewhere** (daemons a → b), per diff size in ``--sizes``
   (bytes, split into ``--files`` files of random bytes), ``--rounds`` rounds
   after one untimed warm-up round (the base's blob into the registry, the
   base into b). Per round, untimed: the files generated in a host directory,
   written into a sandbox on a's graph root and checkpointed (a node). Then,
   in rotating order (round ``r`` starts at variant ``r mod 3``):

   - ``tar``: ``tar c -C SRC . | tar x -C DST`` of the host directory into a
     new directory on the same disk (the baseline: the same bytes copied
     locally, no registry, no hashing, no compression, no fsync);
   - ``raw``: the registry's floor — one blob of the same bytes (new random
     data, the same size) uploaded monolithically (``POST`` + ``PUT
     ?digest=``) and downloaded (``GET``) over HTTP from this process;
   - ``transfer``: ``Push`` of the node from a (its layer gzip-compressed,
     only the blobs the registry lacks sent), ``Pull`` on b, then a sandbox
     on the pulled node on b answering ``exec ["true"]`` — each phase timed
     apart, the total their sum.

   Then, per round, a ``Pull`` of the same node on b again (timed; the access
   log must show no GET of a layer blob — the manifest and the small config
   blob are read — and the answer ``layers_fetched`` 0), and once
   per size a **re-push**: a child of the round's last node with one more
   4 KiB file, pushed from a (timed; the blob uploads counted in the access
   log: the small layer and the image config).

2. **Rollouts on Ray**: a local cluster (``ray.cluster_utils.Cluster``) of
   two nodes told apart by the custom resources ``layerstack-a`` /
   ``layerstack-b`` (one CPU each), a :class:`layerstack.ray.Worker` on each
   next to daemon a / b, the run recorded on the coordinator. One untimed
   warm-up step on both workers (each pulls the task node once), then
   ``--ray-rounds`` rounds of three steps of ``--ray-n`` samples each, in
   rotating order: one worker with ``--slots`` attempts at once, two workers
   with ``--slots`` each, and one worker with twice ``--slots`` (the slots of
   two, on one node). Each sample: ``BeginRollout(worker=…)`` on the
   coordinator, on the worker a sandbox on the task node, ``echo N >
   /work/answer``, its checkpoint, the grader ``test -s /work/answer`` in a
   clean sandbox over it, the checkpoint pushed; the coordinator pulls it and
   ends the attempt (``fan_out_ray``). Rate: samples / the step's wall time.
   Every step's samples must be rewarded 1.0 once, the audit clean.

Prints one JSON line on stdout (ms, s and bytes, raw samples included);
errors on stderr with a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import layerstack
import layerstack.aio
from layerstack.fabric import Grader

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError as e:  # the scenario fails, naming the fix
    sys.exit(f"p10.py needs Ray in this Python ({sys.executable}): {e}; pip install './clients/python[ray]'")

import layerstack.ray as lsray  # noqa: E402

#: Bytes of each Ray node's object store (the minimum Ray takes is 75 MiB).
OBJECT_STORE = 80 * 1024 * 1024

GRADER = Grader(["sh", "-c", "test -s /work/answer"], name="answer-written", version="1")

#: The file the re-push's layer adds.
REPUSH_BYTES = 4096

_ACCESS = re.compile(r'\] "(\w+) (\S+) HTTP/[\d.]+" (\d{3}) ')


def access_log(path: Path) -> List[Tuple[str, str, int]]:
    """(method, path without query, status) of every access-log line so far."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = _ACCESS.search(line)
        if m:
            out.append((m.group(1), m.group(2).split("?")[0], int(m.group(3))))
    return out


def blob_uploads(log: Path) -> int:
    """Blob uploads completed (``PUT …/blobs/uploads/UUID?digest=…`` → 201)."""
    return sum(1 for m, p, s in access_log(log) if m == "PUT" and s == 201 and "/blobs/uploads/" in p)


def blob_gets(log: Path, digests: List[str]) -> int:
    """``GET …/blobs/DIGEST`` requests so far of any of ``digests``."""
    return sum(1 for m, p, _ in access_log(log)
               if m == "GET" and "/blobs/" in p and p.rsplit("/", 1)[-1] in digests)


def layer_digests(reference: str) -> List[str]:
    """The layer digests of the OCI manifest at ``reference``
    (``HOST:PORT/REPO:TAG``), read over plain HTTP."""
    host, rest = reference.split("/", 1)
    repo, tag = rest.rsplit(":", 1)
    h, port = host.rsplit(":", 1)
    c = http.client.HTTPConnection(h, int(port), timeout=60)
    try:
        c.request("GET", f"/v2/{repo}/manifests/{tag}",
                  headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        r = c.getresponse()
        body = r.read()
        if r.status != 200:
            raise RuntimeError(f"GET manifest {reference}: {r.status}")
        return [layer["digest"] for layer in json.loads(body)["layers"]]
    finally:
        c.close()


def rootfs(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "work").mkdir()
    shutil.copy(shutil.which("busybox") or "/bin/busybox", root / "bin" / "busybox")
    for applet in ("sh", "cat", "echo", "ls", "true", "test", "mkdir", "rm"):
        os.symlink("busybox", root / "bin" / applet)
    (root / "etc" / "passwd").write_text("root:x:0:0:session root:/root:/bin/sh\n")
    return root


def make_files(d: Path, total: int, files: int) -> List[Tuple[str, bytes]]:
    """``files`` files of random bytes summing to ``total`` bytes in a new
    directory ``d``; returns (name, data) of each."""
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    each, extra = divmod(total, files)
    out = []
    for i in range(files):
        data = os.urandom(each + (1 if i < extra else 0))
        (d / f"f{i:02}").write_bytes(data)
        out.append((f"f{i:02}", data))
    return out


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def tar_copy(src: Path, dst: Path) -> float:
    """``tar c -C src . | tar x -C dst`` into a new ``dst``; ms."""
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    p = subprocess.run(f"tar c -C '{src}' . | tar x -C '{dst}'", shell=True, capture_output=True)
    t = ms(t0)
    if p.returncode != 0:
        raise RuntimeError(f"tar c | tar x: exit {p.returncode}: {p.stderr[-500:]!r}")
    shutil.rmtree(dst)
    return t


def raw_blob(host: str, data: bytes) -> Tuple[float, float]:
    """Uploads ``data`` as one blob (monolithic: ``POST`` then ``PUT
    ?digest=``) and downloads it (``GET``) over one HTTP connection; (up ms,
    down ms). The digest is computed before the clock starts."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    h, port = host.rsplit(":", 1)
    c = http.client.HTTPConnection(h, int(port), timeout=300)
    c.connect()
    # http.client writes headers and body apart: without this, Nagle's
    # algorithm and the server's delayed ACK add ~40 ms to a small upload.
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        t0 = time.perf_counter()
        c.request("POST", "/v2/p10/raw/blobs/uploads/", headers={"Content-Length": "0"})
        r = c.getresponse()
        r.read()
        if r.status != 202:
            raise RuntimeError(f"POST blobs/uploads/: {r.status}")
        loc = r.getheader("Location") or ""
        loc = re.sub(r"^https?://[^/]+", "", loc)
        sep = "&" if "?" in loc else "?"
        c.request("PUT", f"{loc}{sep}digest={digest}", body=data,
                  headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))})
        r = c.getresponse()
        r.read()
        if r.status != 201:
            raise RuntimeError(f"PUT blob: {r.status}")
        up = ms(t0)
        t1 = time.perf_counter()
        c.request("GET", f"/v2/p10/raw/blobs/{digest}")
        r = c.getresponse()
        got = r.read()
        down = ms(t1)
        if r.status != 200 or len(got) != len(data):
            raise RuntimeError(f"GET blob: {r.status}, {len(got)} of {len(data)} bytes")
        return up, down
    finally:
        c.close()


async def checkpoint(a: layerstack.aio.AsyncClient, node: str, files: List[Tuple[str, bytes]], name: str) -> str:
    """A child of ``node`` on daemon a holding ``files`` under /work/p10."""
    async with a.sandbox(node=node, name=name) as sb:
        for f, data in files:
            await sb.files.write(f"/work/p10/{f}", data)
        closed = await sb.close(checkpoint=True, state={"p10": name})
    if not closed.node:
        raise RuntimeError(f"checkpoint {name} made no node: {closed.outcome} {closed.message}")
    return closed.node


async def transfer_once(a: layerstack.aio.AsyncClient, b: layerstack.aio.AsyncClient, ref: str, node: str,
                        probe: Tuple[str, int], log: Path) -> Dict[str, Any]:
    """Push ``node`` from a, pull it on b, a sandbox there answering ``true``;
    then a pull again. Checks what each answered."""
    up0 = blob_uploads(log)
    t0 = time.perf_counter()
    pushed = await a.push(ref, node=node)
    t1 = time.perf_counter()
    pulled = await b.pull(ref)
    t2 = time.perf_counter()
    sb = await b.sandbox(node=node, name=f"p10-first-{node}")
    res = await sb.exec(["true"])
    t3 = time.perf_counter()
    try:
        if not res.ok:
            raise RuntimeError(f"`true` on the pulled node {node} exited {res.exit_code}: {res.stderr[-300:]!r}")
        st = await sb.files.stat(f"/work/p10/{probe[0]}")
        if st.size != probe[1]:
            raise RuntimeError(f"/work/p10/{probe[0]} on b: {st.size} bytes, not {probe[1]}")
    finally:
        await sb.discard("P10 first session")
    uploads = blob_uploads(log) - up0
    if pulled.node != node or not pulled.created or pulled.layers_fetched != 1:
        raise RuntimeError(f"the pull of {ref} on b answered {pulled}")
    if pushed.layers_packed != 1 or pushed.blobs_sent != 2 or uploads != 2:
        raise RuntimeError(f"the push of {ref}: {pushed}; the registry saw {uploads} blob uploads")
    layers = layer_digests(ref)
    gets0 = blob_gets(log, layers)
    t4 = time.perf_counter()
    again = await b.pull(ref)
    t5 = time.perf_counter()
    gets = blob_gets(log, layers) - gets0
    if again.created or again.layers_fetched != 0 or gets != 0:
        raise RuntimeError(f"the pull again of {ref} fetched: {again}; {gets} layer blob GETs")
    return {
        "push_ms": (t1 - t0) * 1e3,
        "pull_ms": (t2 - t1) * 1e3,
        "session_ms": (t3 - t2) * 1e3,
        "total_ms": (t3 - t0) * 1e3,
        "pull_again_ms": (t5 - t4) * 1e3,
        "push_bytes_sent": pushed.bytes_sent,
        "pull_bytes_fetched": pulled.bytes_fetched,
        "pull_again_bytes_fetched": again.bytes_fetched,
        "blob_uploads": uploads,
    }


async def transfers(args: argparse.Namespace, scratch: Path, log: Path) -> Dict[str, Any]:
    with layerstack.connect(args.a) as sync_a:
        stack = sync_a.import_base(rootfs(scratch / "rootfs-transfer"))
        root = sync_a.create_graph(f"p10-transfer-{os.getpid()}", stack).root
    repo = f"{args.registry}/p10/transfer"
    out: Dict[str, Any] = {"files": args.files, "rounds": args.rounds, "by_size": []}
    async with layerstack.aio.connect(args.a) as a, layerstack.aio.connect(args.b) as b:
        # Warm-up (untimed): the base's blob into the registry, the base into b.
        files = make_files(scratch / "src", 4096, 1)
        node = await checkpoint(a, root, files, "warm")
        pushed = await a.push(f"{repo}:{node}", node=node)
        pulled = await b.pull(f"{repo}:{node}")
        if not pulled.base_imported or pushed.blobs_sent != 3:
            raise RuntimeError(f"the warm-up: push {pushed}; pull {pulled}")
        for size in args.sizes:
            row: Dict[str, Any] = {"bytes": size, "tar_ms": [], "raw_ms": [], "raw_up_ms": [], "raw_down_ms": [],
                                   "push_ms": [], "pull_ms": [], "session_ms": [], "total_ms": [],
                                   "pull_again_ms": [], "push_bytes_sent": [], "pull_bytes_fetched": [],
                                   "pull_again_bytes_fetched": [], "blob_uploads": []}
            last = root
            for r in range(args.rounds):
                src = scratch / "src"
                files = make_files(src, size, args.files)
                node = await checkpoint(a, root, files, f"s{size}-r{r}")
                raw_data = os.urandom(size)
                for k in range(3):
                    v = (r + k) % 3
                    if v == 0:
                        row["tar_ms"].append(tar_copy(src, scratch / "dst"))
                    elif v == 1:
                        up, down = raw_blob(args.registry, raw_data)
                        row["raw_up_ms"].append(up)
                        row["raw_down_ms"].append(down)
                        row["raw_ms"].append(up + down)
                    else:
                        one = await transfer_once(a, b, f"{repo}:{node}", node, (files[0][0], len(files[0][1])), log)
                        for key, val in one.items():
                            row[key].append(val)
                last = node
            # Re-push: one more small layer over the last node.
            child = await checkpoint(a, last, [("small", os.urandom(REPUSH_BYTES))], f"s{size}-repush")
            up0 = blob_uploads(log)
            t0 = time.perf_counter()
            pushed = await a.push(f"{repo}:{child}", node=child)
            row["repush"] = {
                "ms": ms(t0),
                "blob_uploads": blob_uploads(log) - up0,
                "blobs_sent": pushed.blobs_sent,
                "blobs_present": pushed.blobs_present,
                "bytes_sent": pushed.bytes_sent,
                "layers": pushed.layers,
                "layers_packed": pushed.layers_packed,
            }
            if pushed.layers_packed != 1 or row["repush"]["blob_uploads"] != 2:
                raise RuntimeError(f"the re-push of {child}: {pushed}; {row['repush']}")
            out["by_size"].append(row)
    shutil.rmtree(scratch / "src", ignore_errors=True)
    return out


async def write_answer(r: Any) -> None:
    """The policy's action: the sample's number into /work/answer."""
    out = await r.exec(["sh", "-c", f"echo {r.key.sample} > /work/answer"])
    if not out.ok:
        raise RuntimeError(f"the action exited {out.exit_code}: {out.stderr[-300:]!r}")


async def ray_step(args: argparse.Namespace, run: str, root: str, step: int, n: int, workers: List[Any],
                   slots: int) -> Dict[str, Any]:
    async with layerstack.aio.connect(args.coordinator) as c:
        t0 = time.perf_counter()
        results = [
            r async for r in lsray.fan_out_ray(
                c, run, root, n, write_answer, workers=workers, registry=f"{args.registry}/p10/{run}",
                step=step, prompt="answer", grader=GRADER, per_worker=slots, max_attempts=3,
            )
        ]
        wall = time.perf_counter() - t0
        audit = await c.audit_run(run)
    bad = [r for r in results if r.reward != 1.0 or r.attempt is None or not r.attempt.applied]
    if bad or len(results) != n:
        raise RuntimeError(f"step {step}: {len(results)} of {n} results; not rewarded once: "
                           + "; ".join(f"{r!r} {' | '.join(r.errors)}"[:600] for r in bad[:3]))
    if audit.violations:
        raise RuntimeError(f"step {step}: the audit found violations: {audit.violations}")
    by: Dict[str, int] = {}
    for r in results:
        assert r.attempt is not None
        by[r.attempt.worker] = by.get(r.attempt.worker, 0) + 1
    retried = sum(1 for r in results if r.attempt is not None and r.attempt.attempt > 1)
    return {"wall_s": wall, "rate": n / wall, "by_worker": sorted(by.values(), reverse=True), "retried": retried}


def rollouts(args: argparse.Namespace, scratch: Path) -> Dict[str, Any]:
    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"layerstack-a": 1},
                        "object_store_memory": OBJECT_STORE, "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, resources={"layerstack-b": 1}, object_store_memory=OBJECT_STORE)
        ray.init(address=cluster.address, log_to_driver=False)
        nodes: Dict[str, str] = {}
        for nd in ray.nodes():
            for name in ("a", "b"):
                if f"layerstack-{name}" in nd["Resources"]:
                    nodes[name] = nd["NodeID"]
        if set(nodes) != {"a", "b"}:
            raise RuntimeError(f"the Ray cluster's nodes: {ray.nodes()}")
        wa = lsray.start_worker(nodes["a"], args.a, name="a")
        wb = lsray.start_worker(nodes["b"], args.b, name="b")
        ray.get([wa.capabilities.remote(), wb.capabilities.remote()])
        started = time.perf_counter() - t0

        with layerstack.connect(args.coordinator) as c:
            stack = c.import_base(rootfs(scratch / "rootfs-ray"))
            g = c.create_graph(f"p10-ray-{os.getpid()}", stack)
        run = f"p10-ray-{os.getpid()}"

        async def create_run() -> None:
            async with layerstack.aio.connect(args.coordinator) as ac:
                await ac.create_run(run, g.name)

        asyncio.run(create_run())
        # Warm-up (untimed): each worker pulls the task node once.
        warm = asyncio.run(ray_step(args, run, g.root, 0, 4 * args.slots, [wa, wb], args.slots))
        caps = ray.get([wa.capabilities.remote(), wb.capabilities.remote()])
        if not all(g.root in cp.nodes for cp in caps):
            raise RuntimeError(f"after the warm-up step a worker does not hold the task node: {caps}")
        variants = [
            ("one", [wa], args.slots),
            ("two", [wa, wb], args.slots),
            ("one-wide", [wa], 2 * args.slots),
        ]
        res: Dict[str, List[Dict[str, Any]]] = {v[0]: [] for v in variants}
        step = 1
        for r in range(args.ray_rounds):
            for k in range(len(variants)):
                name, workers, slots = variants[(r + k) % len(variants)]
                res[name].append(asyncio.run(ray_step(args, run, g.root, step, args.ray_n, workers, slots)))
                step += 1
        pulls = {cp.name: cp.pulls for cp in ray.get([wa.capabilities.remote(), wb.capabilities.remote()])}
        return {
            "cluster_start_s": started,
            "n": args.ray_n,
            "rounds": args.ray_rounds,
            "slots": args.slots,
            "cores": os.cpu_count(),
            "warmup": warm,
            "pulls": pulls,
            "ray": ray.__version__,
            **res,
        }
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True, help="the coordinating daemon's admin socket")
    p.add_argument("--a", required=True, help="worker a's daemon's admin socket (the pushing side)")
    p.add_argument("--b", required=True, help="worker b's daemon's admin socket (the pulling side)")
    p.add_argument("--registry", required=True, help="127.0.0.1:PORT of the registry (plain HTTP)")
    p.add_argument("--registry-log", required=True, type=Path, help="the registry's log (its access log)")
    p.add_argument("--scratch", required=True, type=Path, help="a directory for the files (same disk as the stores)")
    p.add_argument("--sizes", required=True, type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ray-n", type=int, default=64)
    p.add_argument("--ray-rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=os.cpu_count() or 1,
                   help="attempts at once per worker (fan_out_ray's per_worker; its default is the cores)")
    a = p.parse_args()
    a.scratch.mkdir(parents=True, exist_ok=True)
    t = asyncio.run(transfers(a, a.scratch, a.registry_log))
    r = rollouts(a, a.scratch)
    print(json.dumps({"python": sys.version.split()[0], "transfer": t, "ray": r}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
