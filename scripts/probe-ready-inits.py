"""A/B of `[sandbox] ready_inits` on one build: create + exec `true` +
discard from the sync Python client, daemons alternating ready_inits = 0
and 2 (docs/architecture.md, "Ready inits"). Needs root and busybox-static.

    PYTHONPATH=clients/python/src python3 scripts/probe-ready-inits.py \
        target/release [ROUNDS=3] [N=200]

Prints per-daemon medians (ms), then pooled medians and the ratios.
"""
import os, subprocess, sys, time, statistics, shutil, json
from pathlib import Path
import layerstack

BIN = Path(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200
PAUSE = 0.02
work = Path(os.environ.get("TMPDIR", "/tmp")) / "layerstack-ready-inits-probe"
shutil.rmtree(work, ignore_errors=True)
rootfs = work / "rootfs"
(rootfs / "bin").mkdir(parents=True)
shutil.copy("/bin/busybox", rootfs / "bin/busybox")
for a in ["sh", "true", "cat", "echo", "ls"]:
    os.symlink("busybox", rootfs / "bin" / a)
for d in ["etc", "tmp", "work"]:
    (rootfs / d).mkdir()

def run(ready: int, k: int):
    d = work / f"d{k}"
    (d / "s").mkdir(parents=True)
    cfg = d / "daemon.toml"
    cfg.write_text(f"[sandbox]\nready_inits = {ready}\n")
    admin = d / "s/admin.sock"
    log = open(d / "daemon.log", "wb")
    p = subprocess.Popen([str(BIN / "containerd-layerstack-grpc"), "--config", str(cfg),
                          "--root", str(d / "root"), "--address", str(d / "s/snap.sock"),
                          "--admin-address", str(admin), "--containerd-address", str(d / "s/c.sock"),
                          "--metrics-address", "127.0.0.1:0"], stdout=log, stderr=log,
                         env={**os.environ, "RUST_LOG": "warn"})
    try:
        t0 = time.time()
        while not admin.exists():
            assert time.time() - t0 < 30 and p.poll() is None
            time.sleep(0.02)
        stack = subprocess.run([str(BIN / "layerstack"), "base", "import", "--admin-address", str(admin), str(rootfs)],
                               check=True, capture_output=True, text=True).stdout.strip()
        time.sleep(0.3)
        creates, totals = [], []
        with layerstack.connect(str(admin)) as c:
            for i in range(N + 10):
                time.sleep(PAUSE)
                a = time.perf_counter()
                sb = c.sandbox(stack)
                b = time.perf_counter()
                sb.exec(["true"])
                sb.discard()
                e = time.perf_counter()
                if i >= 10:
                    creates.append((b - a) * 1e3)
                    totals.append((e - a) * 1e3)
        return creates, totals
    finally:
        p.terminate()
        p.wait(timeout=20)

res = {0: ([], []), 2: ([], [])}
k = 0
for r in range(ROUNDS):
    for ready in ([0, 2] if r % 2 == 0 else [2, 0]):
        c, t = run(ready, k)
        k += 1
        res[ready][0].extend(c)
        res[ready][1].extend(t)
        print(f"round {r} ready_inits={ready}: create median {statistics.median(c):.2f} ms, total median {statistics.median(t):.2f} ms", flush=True)
for ready, (c, t) in res.items():
    q = statistics.quantiles(c, n=100)
    print(json.dumps({"ready_inits": ready, "n": len(c), "create_median_ms": round(statistics.median(c), 3),
                      "create_p99_ms": round(q[98], 3), "total_median_ms": round(statistics.median(t), 3)}))
c0, c2 = statistics.median(res[0][0]), statistics.median(res[2][0])
t0, t2 = statistics.median(res[0][1]), statistics.median(res[2][1])
print(f"create: {c2:.2f} vs {c0:.2f} ms ({c2 / c0:.3f}x); create+exec+discard: {t2:.2f} vs {t0:.2f} ms ({t2 / t0:.3f}x)")
shutil.rmtree(work, ignore_errors=True)
