#!/usr/bin/env python3
"""Renders docs/reliability.md (issue 22) from the records the reliability
suite's tests write when ``LAYERSTACK_RELIABILITY_OUT`` names a directory (one
``<id>.json`` per guarantee: ``{"id", "guarantee", "test", "figures"}``; the
writers are ``layerstack_store::reliability::record`` and the Python tests'
``conftest.record_reliability``).

    scripts/reliability.py --records DIR --out FILE [--run "what ran"] [--require-all]

``--require-all`` fails (exit 1) when a guarantee listed in ``GUARANTEES`` has
no record — a test that should have run did not (``scripts/test.sh`` uses it,
so CI fails when the suite loses a member). A record whose id is not listed
fails too: list it here, in its place in the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

# The table's rows, in order: (id, area). The guarantee's sentence, its test
# command and its figures come from the record itself.
GUARANTEES: List[tuple] = [
    ("crash-points", "crash"),
    ("io-errors", "crash"),
    ("exactly-once", "crash"),
    ("power-cut", "crash"),
    ("concurrency-model", "concurrency"),
    ("concurrency-model-processes", "concurrency"),
    ("sandbox-isolation", "concurrency"),
    ("disk-full", "resources"),
    ("disk-full-containers", "resources"),
    ("memory-bound", "resources"),
    ("hostile-upper", "hostile input"),
    ("capture-race", "hostile input"),
    ("capture-limits", "hostile input"),
    ("fuzz-import", "hostile input"),
    ("fuzz-oci-layout", "hostile input"),
    ("fuzz-import-store", "hostile input"),
    ("fuzz-import-dirs", "hostile input"),
    ("fuzz-admin-input", "hostile input"),
    ("fuzz-session-files", "hostile input"),
    ("callers", "access"),
]

HEADER = """# Reliability

What LayerStack guarantees when things go wrong, each guarantee with the test
that checks it and the figures of its last run. **Generated** by
`scripts/reliability.sh` (the full run; this file) — `scripts/test.sh` runs the
same tests with CI-sized parameters and renders its copy to
`target/reliability/reliability.md`, failing when a guarantee has no record.
Do not edit by hand: change a test or `scripts/reliability.py`.

"""

FOOTER = """
## What the durability profiles lose

| Profile | A crash of the daemon (kill -9, abort) | A power cut or kernel crash |
|---|---|---|
| `disposable` (default: SQLite `synchronous=OFF`, nothing fsynced) | nothing it reported committed: every commit is a finished SQLite transaction in the WAL and its layer was renamed into place before it | recent publishes may be missing, or present with **torn files** (empty or short: their data was still in the page cache) — `power-cut` above counts both. What survives is always a prefix of what was reported. `layerstack fsck --content` names every torn file of a published layer and every torn imported base; such a store is for work that can be redone (CI, RL rollouts whose results live elsewhere) |
| `durable` (`synchronous=FULL`; a publish's files and its layer directory fsynced before the transaction commits) | nothing it reported committed | nothing it reported committed (`power-cut` above), as far as the disk honours flushes |

The power cut is simulated at the block layer: the store's ext4 sits on a loop
device, and the backing file is copied while the publishing process is stopped
right after an outcome was reported — the disk without the page cache's dirty
pages, LazyFS's model (this kernel has no device-mapper, so no
`dm-log-writes`; LazyFS is not packaged). In the `durable` profile the disk is
also cut *inside* a publish, a squash, a GC and a base import, at each
failpoint the operation reaches (the process pauses there while the disk is
copied), and right after each was reported: the operation is there whole or
not at all (there, once reported), and everything reported before it is there.
Not simulated: a disk that reorders writes across a flush (ext4's journal
orders them on a disk that honours flushes).

## What a crash point is

A declared failpoint (`store/src/failpoints.rs`, listed by the suite) sits at
each *durable step*: each change of what the daemon's recovery reads after a
restart — a rename into `l/`, `s/` or out of `staging/`, a SQLite commit, an
unlink or removal of a layer, session or staging directory, an fsync the
durable profile relies on. The writes between two such points (a file staged,
a merged file written into an upper, an xattr set) go to places recovery
treats as unfinished work — a staging directory swept at start-up, an upper
whose session the next publish captures again — so a crash among them leaves
what a crash at the next point leaves; the power-cut cuts at the same points
cover their unsynced data. A crash is therefore not injected at every single
system call, but at every point where one changes what a restart sees.
"""


def _figure(v: object) -> str:
    """A figure as the table shows it: measures to 0.1 (below 1: 3 decimals)."""
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 1 else f"{v:.3f}"
    return str(v)


def render(records: Dict[str, dict], run: str) -> str:
    out = [HEADER]
    if run:
        out.append(f"Last run: {run}\n\n")
    out.append("| Area | Guarantee | Figures | Checked by |\n|---|---|---|---|\n")
    for gid, area in GUARANTEES:
        r = records.get(gid)
        if r is None:
            out.append(f"| {area} | `{gid}`: **not run** | | |\n")
            continue
        figs = ", ".join(f"{k} {_figure(v)}" for k, v in r.get("figures", {}).items())
        guarantee = str(r["guarantee"]).replace("|", "\\|")
        out.append(f"| {area} | {guarantee} | {figs} | `{r['test']}` |\n")
    out.append(FOOTER)
    return "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--run", default="")
    ap.add_argument("--require-all", action="store_true")
    a = ap.parse_args()
    records: Dict[str, dict] = {}
    for f in sorted(a.records.glob("*.json")) if a.records.is_dir() else []:
        doc = json.loads(f.read_text())
        records[doc["id"]] = doc
    known = {g for g, _ in GUARANTEES}
    unknown = sorted(set(records) - known)
    missing = [g for g, _ in GUARANTEES if g not in records]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(render(records, a.run))
    print(f"reliability: {len(records)} of {len(GUARANTEES)} guarantees recorded; wrote {a.out}")
    status = 0
    if unknown:
        print(f"reliability: records with no row in scripts/reliability.py: {', '.join(unknown)}", file=sys.stderr)
        status = 1
    if a.require_all and missing:
        print(f"reliability: FAILED: no record of {', '.join(missing)} (did its test run?)", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
