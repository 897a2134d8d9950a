"""P7b's Python side: sandboxes driven from Python over the admin API with the
installed ``layerstack`` package (clients/python), timed from Python — what a
harness author sees, the SDK's and grpcio's own overhead included.

Started by the Rust scenario (bench/src/scenarios/p7b_sdk.rs) with the admin
socket, the namespace and the stack; it then answers one JSON line on stdout
per JSON line on stdin, so that the Rust side can interleave its samples with
the CLI path's (P7) in one run:

    {"op": "single", "client": "sync"|"aio"}
        one sandbox: create + exec ``true`` + discard;
        → {"total_ms", "create_ms", "exec_ms", "discard_ms"}
    {"op": "exec", "client": "sync"|"aio", "n": N, "warmup": W}
        one live sandbox, W untimed then N timed execs of ``true``;
        → {"samples_ms": [...]}
    {"op": "unary", "n": N, "warmup": W}
        one live sandbox, N ``files.stat("/")`` (a unary RPC whose daemon work
        is an openat + fstat: the floor of a call from Python);
        → {"samples_ms": [...]}
    {"op": "fanout", "n": N, "daemon_pid": PID}
        N sandboxes created concurrently from one asyncio client, each running
        ``true`` once (the wall time ends when every exec has answered); with
        all N idle, the daemon's VmRSS and its children's (the inits') memory,
        and the shape of its process spawner (``spawner_live``);
        then one more ``true`` in each (concurrently) and the same again; then
        all discarded concurrently;
        → {"wall_s", "discard_s", "create_ms": [...], "exec_ms": [...],
           "rss_before_kib", "rss_live_kib", "rss_after_kib", "inits": {...},
           "exec_again_s", "rss_after_exec_kib", "inits_after_exec": {...}}
    {"op": "quit"}

Every reply is one line; a failure answers {"error": "..."} and the process
goes on. Units: ms, s, KiB as named.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

import grpc

import layerstack
import layerstack.aio


def ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def rollup_kib(pid: int) -> Dict[str, int]:
    """/proc/PID/smaps_rollup: Rss, Pss, Private_Clean + Private_Dirty (KiB)."""
    out: Dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                out[parts[0][:-1]] = int(parts[1])
    return {
        "rss": out.get("Rss", 0),
        "pss": out.get("Pss", 0),
        "private": out.get("Private_Clean", 0) + out.get("Private_Dirty", 0),
    }


def shape(pid: int) -> Dict[str, int]:
    """What a fork of ``pid`` copies: its threads, mappings (VMAs) and page
    tables (KiB)."""
    with open(f"/proc/{pid}/maps") as f:
        vmas = sum(1 for _ in f)
    return {"threads": status_kib(pid, "Threads"), "vmas": vmas, "pte_kib": status_kib(pid, "VmPTE")}


SPAWNER_COMM = "ls-spawner"


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def all_children(pid: int) -> List[int]:
    """The live children of every thread of ``pid``."""
    kids: List[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(k) for k in f.read().split())
        except FileNotFoundError:
            pass
    return kids


def children(pid: int) -> List[int]:
    """The daemon's inits (and exec waiters): its children but its process
    spawner, which clones them with CLONE_PARENT."""
    return [k for k in all_children(pid) if comm(k) != SPAWNER_COMM]


def spawner_shape(daemon_pid: int) -> Dict[str, int]:
    """What a fork of the daemon's process spawner copies (empty: none)."""
    for k in all_children(daemon_pid):
        if comm(k) == SPAWNER_COMM:
            try:
                s = shape(k)
                s["rss_kib"] = status_kib(k, "VmRSS")
                return s
            except (FileNotFoundError, ProcessLookupError):
                pass
    return {}


def inits_memory(daemon_pid: int) -> Dict[str, Any]:
    rss, pss, private, pte = [], [], [], []
    for k in children(daemon_pid):
        try:
            m = rollup_kib(k)
            pte.append(status_kib(k, "VmPTE"))
        except (FileNotFoundError, ProcessLookupError):
            continue
        rss.append(m["rss"])
        pss.append(m["pss"])
        private.append(m["private"])
    return {
        "count": len(rss),
        "rss_kib_sum": sum(rss),
        "pss_kib_sum": sum(pss),
        "private_kib_sum": sum(private),
        "pte_kib_sum": sum(pte),
    }


class Driver:
    def __init__(self, admin: str, namespace: str, stack: str) -> None:
        self.admin, self.namespace, self.stack = admin, namespace, stack
        self.ls = layerstack.connect(admin, namespace=namespace)
        self.loop = asyncio.new_event_loop()
        self.als: Any = self.loop.run_until_complete(self._aio_connect())

    async def _aio_connect(self) -> Any:
        return layerstack.aio.connect(self.admin, namespace=self.namespace)

    # ------------------------------------------------------------ single

    def single(self, client: str) -> Dict[str, Any]:
        if client == "aio":
            return self.loop.run_until_complete(self._single_aio())
        t0 = time.perf_counter()
        sb = self.ls.sandbox(self.stack, wait_s=0)
        t1 = time.perf_counter()
        out = sb.exec(["true"])
        t2 = time.perf_counter()
        end = sb.discard()
        t3 = time.perf_counter()
        check_true(out)
        if end.outcome != "discarded":
            raise RuntimeError(f"discard answered outcome {end.outcome!r}: {end.message}")
        return {
            "total_ms": (t3 - t0) * 1e3,
            "create_ms": (t1 - t0) * 1e3,
            "exec_ms": (t2 - t1) * 1e3,
            "discard_ms": (t3 - t2) * 1e3,
        }

    async def _single_aio(self) -> Dict[str, Any]:
        t0 = time.perf_counter()
        sb = await self.als.sandbox(self.stack, wait_s=0)
        t1 = time.perf_counter()
        out = await sb.exec(["true"])
        t2 = time.perf_counter()
        end = await sb.discard()
        t3 = time.perf_counter()
        check_true(out)
        if end.outcome != "discarded":
            raise RuntimeError(f"discard answered outcome {end.outcome!r}: {end.message}")
        return {
            "total_ms": (t3 - t0) * 1e3,
            "create_ms": (t1 - t0) * 1e3,
            "exec_ms": (t2 - t1) * 1e3,
            "discard_ms": (t3 - t2) * 1e3,
        }

    # ------------------------------------------------------------ exec

    def exec_series(self, client: str, n: int, warmup: int) -> Dict[str, Any]:
        if client == "aio":
            return self.loop.run_until_complete(self._exec_aio(n, warmup))
        samples = []
        with self.ls.sandbox(self.stack, wait_s=0) as sb:
            for i in range(warmup + n):
                t = time.perf_counter()
                out = sb.exec(["true"])
                ms = ms_since(t)
                check_true(out)
                if i >= warmup:
                    samples.append(ms)
        return {"samples_ms": samples}

    async def _exec_aio(self, n: int, warmup: int) -> Dict[str, Any]:
        samples = []
        async with self.als.sandbox(self.stack, wait_s=0) as sb:
            for i in range(warmup + n):
                t = time.perf_counter()
                out = await sb.exec(["true"])
                ms = ms_since(t)
                check_true(out)
                if i >= warmup:
                    samples.append(ms)
        return {"samples_ms": samples}

    def unary(self, n: int, warmup: int) -> Dict[str, Any]:
        samples = []
        with self.ls.sandbox(self.stack, wait_s=0) as sb:
            for i in range(warmup + n):
                t = time.perf_counter()
                st = sb.files.stat("/")
                ms = ms_since(t)
                if st.kind != "dir":
                    raise RuntimeError(f"stat / answered kind {st.kind!r}")
                if i >= warmup:
                    samples.append(ms)
        return {"samples_ms": samples}

    # ------------------------------------------------------------ fan-out

    def fanout(self, n: int, daemon_pid: int) -> Dict[str, Any]:
        return self.loop.run_until_complete(self._fanout(n, daemon_pid))

    async def _fanout(self, n: int, daemon_pid: int) -> Dict[str, Any]:
        rss_before = status_kib(daemon_pid, "VmRSS")
        shape_before = shape(daemon_pid)
        inits_before = inits_memory(daemon_pid)
        t0 = time.perf_counter()

        async def one(i: int) -> Any:
            t = time.perf_counter()
            sb = await self.als.sandbox(self.stack, name=f"p7b-{i}", wait_s=60)
            t1 = time.perf_counter()
            out = await sb.exec(["true"])
            check_true(out)
            return sb, (t1 - t) * 1e3, ms_since(t1)

        results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
        wall_s = time.perf_counter() - t0
        live = [r[0] for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        rss_live = status_kib(daemon_pid, "VmRSS")
        shape_live = shape(daemon_pid)
        spawner_live = spawner_shape(daemon_pid)
        inits_live = inits_memory(daemon_pid)
        # The inits are forks (of the daemon's process spawner) that never
        # exec: a page their parent writes after the fork leaves its old copy
        # to the init. Measure again after one more exec in every sandbox
        # (work of the daemon's and the spawner's, nothing of the inits').
        t2 = time.perf_counter()
        again = await asyncio.gather(*(sb.exec(["true"]) for sb in live), return_exceptions=True)
        again_s = time.perf_counter() - t2
        for a in again:
            if isinstance(a, BaseException):
                raise RuntimeError(f"a second exec failed: {a!r}")
            check_true(a)
        rss_worked = status_kib(daemon_pid, "VmRSS")
        inits_worked = inits_memory(daemon_pid)
        t1 = time.perf_counter()
        ends = await asyncio.gather(*(sb.discard() for sb in live), return_exceptions=True)
        discard_s = time.perf_counter() - t1
        bad_ends = [e for e in ends if isinstance(e, BaseException) or e.outcome != "discarded"]
        if failed:
            raise RuntimeError(f"{len(failed)} of {n} sandboxes failed; the first: {failed[0]!r}")
        if bad_ends:
            raise RuntimeError(f"{len(bad_ends)} of {n} discards failed; the first: {bad_ends[0]!r}")
        rss_after = status_kib(daemon_pid, "VmRSS")
        return {
            "n": n,
            "wall_s": wall_s,
            "discard_s": discard_s,
            "create_ms": [r[1] for r in results if not isinstance(r, BaseException)],
            "exec_ms": [r[2] for r in results if not isinstance(r, BaseException)],
            "rss_before_kib": rss_before,
            "rss_live_kib": rss_live,
            "rss_after_kib": rss_after,
            "daemon_before": shape_before,
            "daemon_live": shape_live,
            "spawner_live": spawner_live,
            "inits_before": inits_before,
            "inits": inits_live,
            "exec_again_s": again_s,
            "rss_after_exec_kib": rss_worked,
            "inits_after_exec": inits_worked,
        }


def check_true(out: Any) -> None:
    if out.exit_code != 0:
        raise RuntimeError(f"`true` exited {out.exit_code} (stderr {out.stderr[-300:]!r})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--admin", required=True, help="the daemon's admin socket")
    p.add_argument("--namespace", required=True)
    p.add_argument("--stack", required=True, help="stack id the sandboxes start on")
    a = p.parse_args()
    d = Driver(a.admin, a.namespace, a.stack)
    hello = {
        "ready": True,
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "layerstack": getattr(layerstack, "__version__", ""),
    }
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req["op"]
            if op == "quit":
                break
            if op == "single":
                r = d.single(req.get("client", "sync"))
            elif op == "exec":
                r = d.exec_series(req.get("client", "sync"), int(req["n"]), int(req.get("warmup", 0)))
            elif op == "unary":
                r = d.unary(int(req["n"]), int(req.get("warmup", 0)))
            elif op == "fanout":
                r = d.fanout(int(req["n"]), int(req["daemon_pid"]))
            else:
                r = {"error": f"unknown op {op!r}: one of single, exec, unary, fanout, quit"}
        except Exception as e:  # answered, not fatal: the Rust side reports it
            r = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps(r), flush=True)
    d.ls.close()
    d.loop.run_until_complete(d.als.close())
    d.loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
