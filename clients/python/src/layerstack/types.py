"""Typed answers of the admin API (api/proto/admin.proto), as frozen dataclasses.

Each ``from_pb`` takes the generated protobuf message; times are nanoseconds
since the Unix epoch (``*_ns``), sizes bytes, durations microseconds (``*_us``).
Empty strings and zero ids of the wire format become ``None`` where the proto
says "0 if none" / "" if none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from layerstack._pb import admin_pb2 as pb

__all__ = [
    "Mount",
    "PathCounts",
    "ConflictPath",
    "PathVerdict",
    "Session",
    "RunResult",
    "ExecResult",
    "DryRun",
    "Status",
    "GraphInfo",
    "Node",
    "Attempt",
    "Graph",
    "AttemptStart",
    "MergeResult",
    "PromoteResult",
    "FsckProblem",
    "FsckReport",
    "PullResult",
    "PushResult",
]


def _opt_str(s: str) -> Optional[str]:
    return s if s else None


def _opt_int(i: int) -> Optional[int]:
    return i if i else None


@dataclass(frozen=True)
class Mount:
    """One mount of a session's rootfs (containerd's Mount shape, no target):
    ``type`` "overlay", ``options`` lowerdir (newest first), upperdir, workdir."""

    type: str
    source: str
    options: Tuple[str, ...]

    @classmethod
    def from_pb(cls, m: pb.Mount) -> "Mount":
        return cls(type=m.type, source=m.source, options=tuple(m.options))


@dataclass(frozen=True)
class PathCounts:
    """Verdict counts of an outcome: paths clean, text-merged, in conflict, excluded."""

    clean: int = 0
    merged: int = 0
    conflict: int = 0
    excluded: int = 0

    @classmethod
    def from_pb(cls, c: pb.PathCounts) -> "PathCounts":
        return cls(clean=c.clean, merged=c.merged, conflict=c.conflict, excluded=c.excluded)


@dataclass(frozen=True)
class ConflictPath:
    """A conflicting path (display-escaped, leading "/") and the gate's reason."""

    path: str
    reason: str


@dataclass(frozen=True)
class PathVerdict:
    """One path's verdict: ``status`` clean | merged | conflict | excluded;
    ``raw_path`` the exact bytes, relative."""

    path: str
    status: str
    reason: str
    raw_path: bytes

    @classmethod
    def from_pb(cls, v: pb.PathVerdict) -> "PathVerdict":
        return cls(path=v.path, status=v.status, reason=v.reason, raw_path=v.raw_path)


@dataclass(frozen=True)
class SandboxLimits:
    """A live daemon-owned session's limits, as its cgroup enforces them (the
    daemon's ``Session.limits``; docs/operations.md "Session limits").

    Attributes:
        cpu_millis: CPU time per wall time, thousandths of one CPU; 0: none.
        memory_bytes: memory of the session's processes together, bytes; 0: none.
        pids: processes and threads alive at once, init included; 0: none.
        network: the session shares the daemon's network (False: only ``lo``).
    """

    cpu_millis: int
    memory_bytes: int
    pids: int
    network: bool


@dataclass(frozen=True)
class Session:
    """A session: one container rootfs (Mode A) or one ``session run|create`` (Mode B).

    Attributes:
        id: the session id.
        owner_kind: ``container`` | ``sandbox`` | ``wasi`` | ``operation``.
        owner: ``container:<ns>/<id>`` | ``sandbox:<name>`` | ``wasi:<name>`` | ``operation:<id>``.
        stack: ``<namespace>/<base image top chainID>``.
        branch: the branch whose head it leased ("" for an attempt's session).
        state: ``active`` | ``published`` | ``conflict`` | ``discarded`` — the
            store's: a sandbox whose run ended ``interrupted`` is still
            ``active`` (its writes are kept) with ``outcome`` ``interrupted``;
            ``layerstack session ls`` shows it as ``interrupted``.
        outcome: ``committed`` | ``merged`` (a branch moved) | ``checkpointed``
            (a graph node was made; no branch moved) | ``no-change`` | ``conflict`` |
            ``discarded`` | ``failed`` | ``busy`` | ``unsupported`` | ``unknown`` |
            ``interrupted`` (an infrastructure failure ended the run, not its
            owner — see ``interrupted_by``; the exit status is unknown, nothing
            was published, the writes are kept until discarded), or ``None``
            before the run ended.
        layer: the published layer id (for ``checkpointed``: the node's top
            layer), ``None`` if none.
        message: the daemon's explanation, for people (programs read the fields).
        released: the owner let go (its directories are gone).
        run: the current run, from 1.
        policy: the recorded exit policy (on-exit | on-success | never | checkpoint).
        counts: verdict counts of the outcome.
        conflicts: the first conflicting paths (at most 100, see ``conflicts_truncated``).
        outcome_id: the outcome's id (``Client.outcome_paths``), ``None`` if none.
        dry_run: this is a dry run's answer: nothing was changed.
        node: the graph node the outcome made (the child node of a
            ``checkpointed`` outcome; ``Client.show_node`` shows it), ``None``
            for every other outcome. The daemon's ``Session.node`` field.
        interrupted_by: which infrastructure failure ended an ``interrupted``
            run: ``daemon-restart`` (the daemon that owned the sandbox ended:
            kill -9, crash, upgrade) | ``init-gone`` (the sandbox's init died
            while the daemon ran); ``None`` for every other outcome.
        daemon_owned: the daemon started and owns the session's init (a
            sandbox of ``Client.sandbox``), not a ``layerstack`` holder process.
        limits: a live daemon-owned session's limits and network
            (:class:`SandboxLimits`); ``None`` for every other session and once
            its init ended.
        branch_created: only in the answer of the call that created the
            session: its branch did not exist and that call created it, forked
            from the default branch's head (a misspelt branch name makes a new
            branch; this tells). ``False`` in every later answer.
        id_map: the sandbox's uid/gid mapping ``(host_uid, host_gid,
            size)`` (``Client.sandbox(id_map=…)`` or the daemon's default);
            ``None``: its root is the host's root.
    """

    id: int
    owner_kind: str
    owner: str
    namespace: str
    container: str
    stack: str
    branch: str
    state: str
    outcome: Optional[str]
    layer: Optional[int]
    message: str
    released: bool
    run: int
    policy: Optional[str]
    counts: PathCounts
    conflicts: Tuple[ConflictPath, ...]
    conflicts_truncated: bool
    outcome_id: Optional[int]
    dry_run: bool
    node: Optional[str] = None
    interrupted_by: Optional[str] = None
    daemon_owned: bool = False
    limits: Optional[SandboxLimits] = None
    branch_created: bool = False
    id_map: Optional[Tuple[int, int, int]] = None

    @classmethod
    def from_pb(cls, s: pb.Session) -> "Session":
        return cls(
            id=s.id,
            owner_kind=s.owner_kind,
            owner=s.owner,
            namespace=s.namespace,
            container=s.container,
            stack=s.stack,
            branch=s.branch,
            state=s.state,
            outcome=_opt_str(s.outcome),
            layer=_opt_int(s.layer),
            message=s.message,
            released=s.released,
            run=s.run,
            policy=_opt_str(s.policy),
            counts=PathCounts.from_pb(s.counts),
            conflicts=tuple(ConflictPath(c.path, c.reason) for c in s.conflicts),
            conflicts_truncated=s.conflicts_truncated,
            outcome_id=_opt_int(s.outcome_id),
            dry_run=s.dry_run,
            node=_opt_str(s.node),
            interrupted_by=_opt_str(s.interrupted_by),
            daemon_owned=s.daemon_owned,
            limits=(
                SandboxLimits(
                    cpu_millis=s.limits.cpu_millis,
                    memory_bytes=s.limits.memory_bytes,
                    pids=s.limits.pids,
                    network=s.limits.network,
                )
                if s.HasField("limits")
                else None
            ),
            branch_created=s.branch_created,
            id_map=(
                (s.id_map.host_uid, s.id_map.host_gid, s.id_map.size) if s.HasField("id_map") else None
            ),
        )

    @classmethod
    def from_json(cls, v: Dict[str, Any]) -> "Session":
        """From the JSON the ``layerstack`` binary writes (``--outcome``, ``--json``)."""
        c = v.get("counts") or {}
        return cls(
            id=int(v["id"]),
            owner_kind=v.get("owner_kind", ""),
            owner=v.get("owner", ""),
            namespace=v.get("namespace", ""),
            container=v.get("container", ""),
            stack=v.get("stack", ""),
            branch=v.get("branch", ""),
            state=v.get("state", ""),
            outcome=v.get("outcome"),
            layer=v.get("layer"),
            message=v.get("message", ""),
            released=bool(v.get("released", False)),
            run=int(v.get("run", 0)),
            policy=v.get("policy"),
            counts=PathCounts(
                clean=int(c.get("clean", 0)),
                merged=int(c.get("merged", 0)),
                conflict=int(c.get("conflict", 0)),
                excluded=int(c.get("excluded", 0)),
            ),
            conflicts=tuple(
                ConflictPath(x["path"], x.get("reason", "")) for x in v.get("conflicts") or []
            ),
            conflicts_truncated=bool(v.get("conflicts_truncated", False)),
            outcome_id=v.get("outcome_id"),
            dry_run=bool(v.get("dry_run", False)),
            node=v.get("node") or None,
            interrupted_by=v.get("interrupted_by") or None,
            daemon_owned=bool(v.get("daemon_owned", False)),
            limits=(
                SandboxLimits(
                    cpu_millis=int(v["limits"].get("cpu_millis", 0)),
                    memory_bytes=int(v["limits"].get("memory_bytes", 0)),
                    pids=int(v["limits"].get("pids", 0)),
                    network=bool(v["limits"].get("network", False)),
                )
                if v.get("limits")
                else None
            ),
            branch_created=bool(v.get("branch_created", False)),
        )

    @property
    def checkpoint_node(self) -> Optional[str]:
        """The child node a checkpointing end made, else ``None``: :attr:`node`
        (kept for callers of the name; read from the field, never the message)."""
        return self.node


@dataclass(frozen=True)
class RunResult:
    """A finished ``Client.run``: the command's exit status (127 not found, 126 not
    executable, 128+n killed by signal n), its output, and the session's outcome.

    ``stderr`` is the command's own (the binary's one outcome line is removed).
    ``node`` is the child node when the run checkpointed, else ``None``.
    """

    exit_status: int
    stdout: bytes
    stderr: bytes
    session: Session

    @property
    def node(self) -> Optional[str]:
        """The child node the run checkpointed into (``session.node``), else ``None``."""
        return self.session.node


@dataclass(frozen=True)
class ExecResult:
    """A command run in a live session (``Client.exec``): exit status and output."""

    exit_status: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class DryRun:
    """What a publish would do now (nothing changed): the would-be outcome and
    every path's verdict, in path order."""

    session: Session
    paths: Tuple[PathVerdict, ...]


@dataclass(frozen=True)
class Status:
    """The daemon's status: version, store root, containerd connection, Mode B cap."""

    version: str
    root: str
    containerd_address: str
    events_subscribed: bool
    default_branch: str
    pid: int
    mount_address: str
    sandbox_sessions: int
    sandbox_max_sessions: int
    #: Executors the daemon can run sessions with now: "linux", "wasi".
    executors: Tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, s: pb.StatusResponse) -> "Status":
        return cls(
            version=s.version,
            root=s.root,
            containerd_address=s.containerd_address,
            events_subscribed=s.events_subscribed,
            default_branch=s.default_branch,
            pid=s.pid,
            mount_address=s.mount_address,
            sandbox_sessions=s.sandbox_sessions,
            sandbox_max_sessions=s.sandbox_max_sessions,
            executors=tuple(s.executors),
        )


@dataclass(frozen=True)
class GraphInfo:
    """A graph (group): its name, the stack and branch it was made on, its root node."""

    name: str
    stack: str
    branch: str
    root: str
    created_ns: int

    @classmethod
    def from_pb(cls, g: pb.GraphGroup) -> "GraphInfo":
        return cls(name=g.name, stack=g.stack, branch=g.branch, root=g.root, created_ns=g.created_ns)


@dataclass(frozen=True)
class Node:
    """An immutable node: a root (manifest) + logical state + provenance.

    Attributes:
        id: the node id.
        graph: the graph (group) it belongs to.
        kind: ``root`` | ``checkpoint`` | ``merge``.
        manifest: the manifest id of its root.
        state: the logical state given at checkpoint (a JSON object, parsed).
        parents: parent node ids this store holds (one for a checkpoint, two for a
            merge, none for a root), in declared order: the graph's edges.
        attempt: the attempt it came from, ``None`` if none.
        command: the command that produced it (provenance), ``None`` if none.
        labels: container labels (container attempts).
        exit_status: the attempt's exit status, ``None`` if unknown.
        private_bytes: bytes of its own layer (real allocation).
        base_digest: the stack's base digest.
        pruned: pruned (collectable unless something still reaches it).
        created_ns: creation time.
        missing_parents: parents the node declares that this store does not hold
            (it was pulled before them), in declared order; a pull of such a
            parent makes its edge (it moves to ``parents``).
        declared_parents: every parent the node declares, held here or not,
            in declared order (``parents`` and ``missing_parents`` merged as
            the node made them).
    """

    id: str
    graph: str
    kind: str
    manifest: int
    state: Dict[str, Any]
    parents: Tuple[str, ...]
    attempt: Optional[int]
    command: Optional[str]
    labels: Dict[str, str]
    exit_status: Optional[int]
    private_bytes: int
    base_digest: str
    pruned: bool
    created_ns: int
    missing_parents: Tuple[str, ...] = ()
    declared_parents: Tuple[str, ...] = ()

    @classmethod
    def from_pb(cls, n: pb.Node) -> "Node":
        try:
            state = json.loads(n.state) if n.state else {}
        except ValueError:
            state = {"_raw": n.state}
        if not isinstance(state, dict):
            state = {"_value": state}
        return cls(
            id=n.id,
            graph=n.group,
            kind=n.kind,
            manifest=n.manifest,
            state=state,
            parents=tuple(n.parents),
            attempt=_opt_int(n.attempt),
            command=_opt_str(n.command),
            labels=dict(n.labels),
            exit_status=n.exit_status if n.has_exit_status else None,
            private_bytes=n.private_bytes,
            base_digest=n.base_digest,
            pruned=n.pruned,
            created_ns=n.created_ns,
            missing_parents=tuple(n.missing_parents),
            declared_parents=tuple(n.declared_parents),
        )


@dataclass(frozen=True)
class Attempt:
    """One activation of a node in a session.

    Attributes:
        status: ``running`` | ``checkpointed`` | ``failed`` (the task: its run
            ended without a checkpoint) | ``abandoned`` (its session vanished) |
            ``interrupted`` (an infrastructure failure ended its session, e.g.
            a daemon restart: not the task's failure; retry the attempt).
        key: the client's idempotency key ("" if none).
        result_node: the child node it checkpointed into, ``None`` if none.
        ended_ns: end time, ``None`` while running.
    """

    id: int
    node: str
    session: Optional[int]
    status: str
    key: str
    result_node: Optional[str]
    message: str
    created_ns: int
    ended_ns: Optional[int]

    @classmethod
    def from_pb(cls, a: pb.Attempt) -> "Attempt":
        return cls(
            id=a.id,
            node=a.node,
            session=_opt_int(a.session),
            status=a.status,
            key=a.key,
            result_node=_opt_str(a.result_node),
            message=a.message,
            created_ns=a.created_ns,
            ended_ns=_opt_int(a.ended_ns),
        )


@dataclass(frozen=True)
class Graph:
    """A whole graph: its group, every node (pruned ones too) and every attempt."""

    info: GraphInfo
    nodes: Tuple[Node, ...]
    attempts: Tuple[Attempt, ...]

    @classmethod
    def from_pb(cls, g: pb.Graph) -> "Graph":
        return cls(
            info=GraphInfo.from_pb(g.group),
            nodes=tuple(Node.from_pb(n) for n in g.nodes),
            attempts=tuple(Attempt.from_pb(a) for a in g.attempts),
        )

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def root(self) -> str:
        return self.info.root

    def node(self, node_id: str) -> Node:
        """The node ``node_id``; ``KeyError`` if it is not in this graph."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def children(self, node_id: str) -> List[Node]:
        """The nodes that have ``node_id`` among their parents."""
        return [n for n in self.nodes if node_id in n.parents]


@dataclass(frozen=True)
class AttemptStart:
    """A started (or retried) attempt: the attempt, its session, the overlay mounts
    for a client that mounts it itself, and ``created`` (False: the key named an
    existing attempt)."""

    attempt: Attempt
    session: Session
    mounts: Tuple[Mount, ...]
    created: bool

    @classmethod
    def from_pb(cls, r: pb.AttemptResponse) -> "AttemptStart":
        return cls(
            attempt=Attempt.from_pb(r.attempt),
            session=Session.from_pb(r.session),
            mounts=tuple(Mount.from_pb(m) for m in r.mounts),
            created=r.created,
        )


@dataclass(frozen=True)
class MergeResult:
    """A merge of two nodes: the merge node, or on conflict ``node`` None and the
    merge's ``session`` (its ``conflicts`` name the paths, with reasons)."""

    node: Optional[Node]
    session: Optional[Session]

    @property
    def conflict(self) -> bool:
        return self.node is None

    @classmethod
    def from_pb(cls, r: pb.MergeNodesResponse) -> "MergeResult":
        return cls(
            node=Node.from_pb(r.node) if r.HasField("node") else None,
            session=Session.from_pb(r.session) if r.HasField("session") else None,
        )


@dataclass(frozen=True)
class PromoteResult:
    """A promote: ``result`` up-to-date | fast-forward | merged | conflict (refused
    whole: the branch keeps its newer work); ``head`` the branch's manifest after;
    ``session`` the merge's session (merged, conflict)."""

    result: str
    head: int
    message: str
    session: Optional[Session] = field(default=None)

    @property
    def refused(self) -> bool:
        return self.result == "conflict"

    @classmethod
    def from_pb(cls, r: pb.PromoteResponse) -> "PromoteResult":
        return cls(
            result=r.result,
            head=r.head,
            message=r.message,
            session=Session.from_pb(r.session) if r.HasField("session") else None,
        )


@dataclass(frozen=True)
class FsckProblem:
    """One inconsistency ``fsck`` found: ``kind`` (orphan-directory |
    layer-missing | manifest-layer | dangling-lease | session-upper-missing |
    index-mismatch | rollout), what it is about, why, and whether ``repair``
    fixed it."""

    kind: str
    subject: str
    detail: str
    repaired: bool


@dataclass(frozen=True)
class FsckReport:
    """The store checked against its filesystem: how much was looked at
    (layers, manifests, leases, sessions, path-index rows, runs, and
    ``outcomes``: committed, merged and checkpointed outcomes checked against
    history) and the problems; ``unrepaired`` counts those still there."""

    layers: int
    manifests: int
    leases: int
    sessions: int
    paths: int
    runs: int
    problems: Tuple[FsckProblem, ...]
    unrepaired: int
    outcomes: int = 0

    @classmethod
    def from_pb(cls, r: pb.FsckReport) -> "FsckReport":
        return cls(
            layers=r.layers,
            manifests=r.manifests,
            leases=r.leases,
            sessions=r.sessions,
            paths=r.paths,
            runs=r.runs,
            problems=tuple(FsckProblem(p.kind, p.subject, p.detail, p.repaired) for p in r.problems),
            unrepaired=r.unrepaired,
            outcomes=r.outcomes,
        )


@dataclass(frozen=True)
class PushResult:
    """What :meth:`layerstack.Client.push` sent: the ``reference`` pushed and
    the ``manifest_digest`` (pull ``REGISTRY/REPO@DIGEST`` for exactly this
    image); the ``node`` ("" for a branch head) and its ``stack``; the image's
    ``layers`` (the base's, then the stack's) and how many of their blobs (and
    the config) were sent (``blobs_sent``, ``bytes_sent`` bytes) or were in
    the registry already (``blobs_present``); ``diff_ids`` oldest first;
    ``layers_packed`` the layers this push read and compressed (the others'
    blobs were recorded by an earlier push, export or pull and present)."""

    reference: str
    manifest_digest: str
    node: str
    stack: str
    layers: int
    blobs_sent: int
    blobs_present: int
    bytes_sent: int
    diff_ids: Tuple[str, ...]
    layers_packed: int = 0

    @classmethod
    def from_pb(cls, r: pb.PushResponse) -> "PushResult":
        return cls(
            reference=r.reference,
            manifest_digest=r.manifest_digest,
            node=r.node,
            stack=r.stack,
            layers=r.layers,
            blobs_sent=r.blobs_sent,
            blobs_present=r.blobs_present,
            bytes_sent=r.bytes_sent,
            diff_ids=tuple(r.diff_ids),
            layers_packed=r.layers_packed,
        )


@dataclass(frozen=True)
class PullResult:
    """What :meth:`layerstack.Client.pull` did: the ``node`` (its id as the
    pushing store made it), its ``stack`` and ``graph``, the image's
    ``manifest_digest``; ``created`` false when the node was here already with
    the same layers (nothing changed); ``base_imported`` when the stack's
    imported base came from the image; the node's ``layers`` above the base,
    ``layers_fetched`` downloaded and ``layers_reused`` held here already (by
    diff ID); ``bytes_fetched``; ``missing_parents``: parents this store does
    not hold (no edge was made to them yet: the node keeps them and a pull of
    one links it); ``linked_children``: nodes pulled here before this one that
    name it as a parent, each linked by this pull. A branch head's image
    (``push(stack=…)``) makes no node: ``node`` and ``graph`` are ``""``.
    ``branch``: the branch pointed at what was pulled (``pull(branch=…)``, or
    the branch a head was pushed from; ``""`` for none), ``branch_result``
    created | up-to-date | fast-forward | merged, ``branch_head`` its
    manifest afterwards, ``branch_session`` the merge's session (merged)."""

    node: str
    stack: str
    graph: str
    manifest_digest: str
    created: bool
    base_imported: bool
    layers: int
    layers_fetched: int
    layers_reused: int
    bytes_fetched: int
    missing_parents: Tuple[str, ...]
    linked_children: Tuple[str, ...] = ()
    branch: str = ""
    branch_result: str = ""
    branch_head: int = 0
    branch_session: Optional[Session] = None

    @classmethod
    def from_pb(cls, r: pb.PullResponse) -> "PullResult":
        return cls(
            node=r.node,
            stack=r.stack,
            graph=r.graph,
            manifest_digest=r.manifest_digest,
            created=r.created,
            base_imported=r.base_imported,
            layers=r.layers,
            layers_fetched=r.layers_fetched,
            layers_reused=r.layers_reused,
            bytes_fetched=r.bytes_fetched,
            missing_parents=tuple(r.missing_parents),
            linked_children=tuple(r.linked_children),
            branch=r.branch,
            branch_result=r.branch_result,
            branch_head=r.branch_head,
            branch_session=Session.from_pb(r.branch_session) if r.HasField("branch_session") else None,
        )


def registry_auth(username: Optional[str], password: Optional[str], token: Optional[str]) -> Optional[pb.RegistryAuth]:
    """The ``RegistryAuth`` of a push or pull (``None``: the daemon's own
    credentials for the registry, else anonymous)."""
    if token is not None and username is not None:
        raise ValueError("give username= and password=, or token=, not both")
    if token is not None:
        return pb.RegistryAuth(token=token)
    if username is not None:
        if password is None:
            raise ValueError("username= needs password=")
        return pb.RegistryAuth(username=username, password=password)
    if password is not None:
        raise ValueError("password= needs username=")
    return None
