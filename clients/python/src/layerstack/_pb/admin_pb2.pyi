from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EndAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBLISH: _ClassVar[EndAction]
    DISCARD: _ClassVar[EndAction]
    AUTO: _ClassVar[EndAction]
    CHECKPOINT: _ClassVar[EndAction]
PUBLISH: EndAction
DISCARD: EndAction
AUTO: EndAction
CHECKPOINT: EndAction

class RegistryAuth(_message.Message):
    __slots__ = ("username", "password", "token")
    USERNAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    username: str
    password: str
    token: str
    def __init__(self, username: _Optional[str] = ..., password: _Optional[str] = ..., token: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("node", "namespace", "stack", "branch", "reference", "auth", "compression")
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    namespace: str
    stack: str
    branch: str
    reference: str
    auth: RegistryAuth
    compression: str
    def __init__(self, node: _Optional[str] = ..., namespace: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., reference: _Optional[str] = ..., auth: _Optional[_Union[RegistryAuth, _Mapping]] = ..., compression: _Optional[str] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("reference", "manifest_digest", "node", "stack", "layers", "blobs_sent", "blobs_present", "bytes_sent", "diff_ids", "layers_packed")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_SENT_FIELD_NUMBER: _ClassVar[int]
    BLOBS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DIFF_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PACKED_FIELD_NUMBER: _ClassVar[int]
    reference: str
    manifest_digest: str
    node: str
    stack: str
    layers: int
    blobs_sent: int
    blobs_present: int
    bytes_sent: int
    diff_ids: _containers.RepeatedScalarFieldContainer[str]
    layers_packed: int
    def __init__(self, reference: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., node: _Optional[str] = ..., stack: _Optional[str] = ..., layers: _Optional[int] = ..., blobs_sent: _Optional[int] = ..., blobs_present: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., diff_ids: _Optional[_Iterable[str]] = ..., layers_packed: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("reference", "auth", "graph", "branch")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    reference: str
    auth: RegistryAuth
    graph: str
    branch: str
    def __init__(self, reference: _Optional[str] = ..., auth: _Optional[_Union[RegistryAuth, _Mapping]] = ..., graph: _Optional[str] = ..., branch: _Optional[str] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("node", "stack", "graph", "manifest_digest", "created", "base_imported", "layers", "layers_fetched", "layers_reused", "bytes_fetched", "missing_parents", "linked_children", "branch", "branch_result", "branch_head", "branch_session")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    BASE_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_REUSED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    MISSING_PARENTS_FIELD_NUMBER: _ClassVar[int]
    LINKED_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    BRANCH_RESULT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_HEAD_FIELD_NUMBER: _ClassVar[int]
    BRANCH_SESSION_FIELD_NUMBER: _ClassVar[int]
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
    missing_parents: _containers.RepeatedScalarFieldContainer[str]
    linked_children: _containers.RepeatedScalarFieldContainer[str]
    branch: str
    branch_result: str
    branch_head: int
    branch_session: Session
    def __init__(self, node: _Optional[str] = ..., stack: _Optional[str] = ..., graph: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., created: _Optional[bool] = ..., base_imported: _Optional[bool] = ..., layers: _Optional[int] = ..., layers_fetched: _Optional[int] = ..., layers_reused: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., missing_parents: _Optional[_Iterable[str]] = ..., linked_children: _Optional[_Iterable[str]] = ..., branch: _Optional[str] = ..., branch_result: _Optional[str] = ..., branch_head: _Optional[int] = ..., branch_session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class FsckRequest(_message.Message):
    __slots__ = ("repair", "content")
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    repair: bool
    content: bool
    def __init__(self, repair: _Optional[bool] = ..., content: _Optional[bool] = ...) -> None: ...

class FsckProblem(_message.Message):
    __slots__ = ("kind", "subject", "detail", "repaired")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    subject: str
    detail: str
    repaired: bool
    def __init__(self, kind: _Optional[str] = ..., subject: _Optional[str] = ..., detail: _Optional[str] = ..., repaired: _Optional[bool] = ...) -> None: ...

class FsckReport(_message.Message):
    __slots__ = ("layers", "manifests", "leases", "sessions", "paths", "runs", "problems", "unrepaired", "outcomes")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    UNREPAIRED_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    layers: int
    manifests: int
    leases: int
    sessions: int
    paths: int
    runs: int
    problems: _containers.RepeatedCompositeFieldContainer[FsckProblem]
    unrepaired: int
    outcomes: int
    def __init__(self, layers: _Optional[int] = ..., manifests: _Optional[int] = ..., leases: _Optional[int] = ..., sessions: _Optional[int] = ..., paths: _Optional[int] = ..., runs: _Optional[int] = ..., problems: _Optional[_Iterable[_Union[FsckProblem, _Mapping]]] = ..., unrepaired: _Optional[int] = ..., outcomes: _Optional[int] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("name", "graph", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    graph: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., graph: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("run", "created")
    RUN_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    run: Run
    created: bool
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("name", "graph", "labels", "created_ns")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    graph: str
    labels: _containers.ScalarMap[str, str]
    created_ns: int
    def __init__(self, name: _Optional[str] = ..., graph: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_ns: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[Run]
    def __init__(self, runs: _Optional[_Iterable[_Union[Run, _Mapping]]] = ...) -> None: ...

class SampleKey(_message.Message):
    __slots__ = ("run", "step", "prompt", "sample")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    prompt: str
    sample: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., prompt: _Optional[str] = ..., sample: _Optional[int] = ...) -> None: ...

class BeginRolloutRequest(_message.Message):
    __slots__ = ("sample", "attempt", "node", "policy", "has_seed", "seed", "sandbox", "wait_ms", "wasi", "worker")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    WASI_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    sample: SampleKey
    attempt: int
    node: str
    policy: str
    has_seed: bool
    seed: int
    sandbox: SandboxOptions
    wait_ms: int
    wasi: WasiOptions
    worker: str
    def __init__(self, sample: _Optional[_Union[SampleKey, _Mapping]] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ..., policy: _Optional[str] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., sandbox: _Optional[_Union[SandboxOptions, _Mapping]] = ..., wait_ms: _Optional[int] = ..., wasi: _Optional[_Union[WasiOptions, _Mapping]] = ..., worker: _Optional[str] = ...) -> None: ...

class BeginRolloutResponse(_message.Message):
    __slots__ = ("attempt", "created", "rewarded", "sample", "session")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    REWARDED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    attempt: RolloutAttempt
    created: bool
    rewarded: bool
    sample: Sample
    session: Session
    def __init__(self, attempt: _Optional[_Union[RolloutAttempt, _Mapping]] = ..., created: _Optional[bool] = ..., rewarded: _Optional[bool] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("key", "node", "has_reward", "reward", "reward_attempt", "attempts", "max_attempt", "running", "task_failed_attempt")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TASK_FAILED_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    key: SampleKey
    node: str
    has_reward: bool
    reward: float
    reward_attempt: int
    attempts: int
    max_attempt: int
    running: _containers.RepeatedScalarFieldContainer[int]
    task_failed_attempt: int
    def __init__(self, key: _Optional[_Union[SampleKey, _Mapping]] = ..., node: _Optional[str] = ..., has_reward: _Optional[bool] = ..., reward: _Optional[float] = ..., reward_attempt: _Optional[int] = ..., attempts: _Optional[int] = ..., max_attempt: _Optional[int] = ..., running: _Optional[_Iterable[int]] = ..., task_failed_attempt: _Optional[int] = ...) -> None: ...

class Evaluator(_message.Message):
    __slots__ = ("name", "version", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class Artifact(_message.Message):
    __slots__ = ("name", "digest", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    digest: str
    size: int
    def __init__(self, name: _Optional[str] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class RolloutAttempt(_message.Message):
    __slots__ = ("id", "sample", "attempt", "node", "session", "graph_attempt", "policy", "has_seed", "seed", "status", "infra_kind", "has_reward", "reward", "accepted", "applied", "evaluator", "result_node", "trajectory", "artifacts", "backpropagated", "backprop", "message", "created_ns", "ended_ns", "worker")
    ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    GRAPH_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INFRA_KIND_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    RESULT_NODE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    BACKPROPAGATED_FIELD_NUMBER: _ClassVar[int]
    BACKPROP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    ENDED_NS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    id: int
    sample: SampleKey
    attempt: int
    node: str
    session: int
    graph_attempt: int
    policy: str
    has_seed: bool
    seed: int
    status: str
    infra_kind: str
    has_reward: bool
    reward: float
    accepted: bool
    applied: bool
    evaluator: Evaluator
    result_node: str
    trajectory: str
    artifacts: _containers.RepeatedCompositeFieldContainer[Artifact]
    backpropagated: bool
    backprop: float
    message: str
    created_ns: int
    ended_ns: int
    worker: str
    def __init__(self, id: _Optional[int] = ..., sample: _Optional[_Union[SampleKey, _Mapping]] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ..., session: _Optional[int] = ..., graph_attempt: _Optional[int] = ..., policy: _Optional[str] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., status: _Optional[str] = ..., infra_kind: _Optional[str] = ..., has_reward: _Optional[bool] = ..., reward: _Optional[float] = ..., accepted: _Optional[bool] = ..., applied: _Optional[bool] = ..., evaluator: _Optional[_Union[Evaluator, _Mapping]] = ..., result_node: _Optional[str] = ..., trajectory: _Optional[str] = ..., artifacts: _Optional[_Iterable[_Union[Artifact, _Mapping]]] = ..., backpropagated: _Optional[bool] = ..., backprop: _Optional[float] = ..., message: _Optional[str] = ..., created_ns: _Optional[int] = ..., ended_ns: _Optional[int] = ..., worker: _Optional[str] = ...) -> None: ...

class EndRolloutRequest(_message.Message):
    __slots__ = ("attempt", "status", "reward", "accepted", "infra_kind", "evaluator", "trajectory", "artifacts", "has_backprop", "backprop", "message", "keep", "state", "labels", "result_node")
    class Keep(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CHECKPOINT: _ClassVar[EndRolloutRequest.Keep]
        DISCARD: _ClassVar[EndRolloutRequest.Keep]
    CHECKPOINT: EndRolloutRequest.Keep
    DISCARD: EndRolloutRequest.Keep
    class ArtifactData(_message.Message):
        __slots__ = ("name", "data")
        NAME_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        name: str
        data: bytes
        def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    INFRA_KIND_FIELD_NUMBER: _ClassVar[int]
    EVALUATOR_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    ARTIFACTS_FIELD_NUMBER: _ClassVar[int]
    HAS_BACKPROP_FIELD_NUMBER: _ClassVar[int]
    BACKPROP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    RESULT_NODE_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    status: str
    reward: float
    accepted: bool
    infra_kind: str
    evaluator: Evaluator
    trajectory: bytes
    artifacts: _containers.RepeatedCompositeFieldContainer[EndRolloutRequest.ArtifactData]
    has_backprop: bool
    backprop: float
    message: str
    keep: EndRolloutRequest.Keep
    state: str
    labels: _containers.ScalarMap[str, str]
    result_node: str
    def __init__(self, attempt: _Optional[int] = ..., status: _Optional[str] = ..., reward: _Optional[float] = ..., accepted: _Optional[bool] = ..., infra_kind: _Optional[str] = ..., evaluator: _Optional[_Union[Evaluator, _Mapping]] = ..., trajectory: _Optional[bytes] = ..., artifacts: _Optional[_Iterable[_Union[EndRolloutRequest.ArtifactData, _Mapping]]] = ..., has_backprop: _Optional[bool] = ..., backprop: _Optional[float] = ..., message: _Optional[str] = ..., keep: _Optional[_Union[EndRolloutRequest.Keep, str]] = ..., state: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., result_node: _Optional[str] = ...) -> None: ...

class ListRolloutsRequest(_message.Message):
    __slots__ = ("run", "has_step", "step", "page_size", "page_token")
    RUN_FIELD_NUMBER: _ClassVar[int]
    HAS_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    run: str
    has_step: bool
    step: int
    page_size: int
    page_token: str
    def __init__(self, run: _Optional[str] = ..., has_step: _Optional[bool] = ..., step: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRolloutsResponse(_message.Message):
    __slots__ = ("attempts", "next_page_token")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    attempts: _containers.RepeatedCompositeFieldContainer[RolloutAttempt]
    next_page_token: str
    def __init__(self, attempts: _Optional[_Iterable[_Union[RolloutAttempt, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class AuditRunRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class RunAudit(_message.Message):
    __slots__ = ("samples", "rewarded", "attempts", "running", "completed", "task_failed", "infra_failed", "backprops", "violations", "by_worker")
    class InfraFailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REWARDED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TASK_FAILED_FIELD_NUMBER: _ClassVar[int]
    INFRA_FAILED_FIELD_NUMBER: _ClassVar[int]
    BACKPROPS_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    samples: int
    rewarded: int
    attempts: int
    running: int
    completed: int
    task_failed: int
    infra_failed: _containers.ScalarMap[str, int]
    backprops: int
    violations: _containers.RepeatedScalarFieldContainer[str]
    by_worker: _containers.ScalarMap[str, int]
    def __init__(self, samples: _Optional[int] = ..., rewarded: _Optional[int] = ..., attempts: _Optional[int] = ..., running: _Optional[int] = ..., completed: _Optional[int] = ..., task_failed: _Optional[int] = ..., infra_failed: _Optional[_Mapping[str, int]] = ..., backprops: _Optional[int] = ..., violations: _Optional[_Iterable[str]] = ..., by_worker: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ReadBlobRequest(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node", "visits", "value_sum", "has_prior", "prior", "frontier")
    NODE_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    VALUE_SUM_FIELD_NUMBER: _ClassVar[int]
    HAS_PRIOR_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    FRONTIER_FIELD_NUMBER: _ClassVar[int]
    node: str
    visits: int
    value_sum: float
    has_prior: bool
    prior: float
    frontier: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., visits: _Optional[int] = ..., value_sum: _Optional[float] = ..., has_prior: _Optional[bool] = ..., prior: _Optional[float] = ..., frontier: _Optional[_Iterable[str]] = ...) -> None: ...

class GetNodeStatsRequest(_message.Message):
    __slots__ = ("node", "children")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    node: str
    children: bool
    def __init__(self, node: _Optional[str] = ..., children: _Optional[bool] = ...) -> None: ...

class GetNodeStatsResponse(_message.Message):
    __slots__ = ("node", "children")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    node: NodeStats
    children: _containers.RepeatedCompositeFieldContainer[NodeStats]
    def __init__(self, node: _Optional[_Union[NodeStats, _Mapping]] = ..., children: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ...) -> None: ...

class SetPriorRequest(_message.Message):
    __slots__ = ("node", "prior")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PRIOR_FIELD_NUMBER: _ClassVar[int]
    node: str
    prior: float
    def __init__(self, node: _Optional[str] = ..., prior: _Optional[float] = ...) -> None: ...

class FrontierRequest(_message.Message):
    __slots__ = ("holder", "nodes")
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    holder: str
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, holder: _Optional[str] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class FrontierResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ImportBaseRequest(_message.Message):
    __slots__ = ("path", "kind", "platform")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: str
    platform: str
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[str] = ..., platform: _Optional[str] = ...) -> None: ...

class ImportBaseResponse(_message.Message):
    __slots__ = ("stack", "digest", "layer", "created", "bytes", "kind", "files", "layers", "manifest", "platform")
    STACK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    stack: str
    digest: str
    layer: int
    created: bool
    bytes: int
    kind: str
    files: int
    layers: int
    manifest: str
    platform: str
    def __init__(self, stack: _Optional[str] = ..., digest: _Optional[str] = ..., layer: _Optional[int] = ..., created: _Optional[bool] = ..., bytes: _Optional[int] = ..., kind: _Optional[str] = ..., files: _Optional[int] = ..., layers: _Optional[int] = ..., manifest: _Optional[str] = ..., platform: _Optional[str] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("namespace", "image", "branch", "node", "compression", "since_layer")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SINCE_LAYER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    image: str
    branch: str
    node: str
    compression: str
    since_layer: int
    def __init__(self, namespace: _Optional[str] = ..., image: _Optional[str] = ..., branch: _Optional[str] = ..., node: _Optional[str] = ..., compression: _Optional[str] = ..., since_layer: _Optional[int] = ...) -> None: ...

class ExportLayer(_message.Message):
    __slots__ = ("layer", "kind", "session", "created_ns", "omitted", "source", "media_type")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kind: str
    session: int
    created_ns: int
    omitted: bool
    source: str
    media_type: str
    def __init__(self, layer: _Optional[int] = ..., kind: _Optional[str] = ..., session: _Optional[int] = ..., created_ns: _Optional[int] = ..., omitted: _Optional[bool] = ..., source: _Optional[str] = ..., media_type: _Optional[str] = ...) -> None: ...

class ExportPlan(_message.Message):
    __slots__ = ("stack", "branch", "node", "manifest", "layers", "compression", "media_type", "base_image", "base_manifest", "base_config", "base_missing", "base_digest")
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_IMAGE_FIELD_NUMBER: _ClassVar[int]
    BASE_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BASE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_MISSING_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    stack: str
    branch: str
    node: str
    manifest: int
    layers: _containers.RepeatedCompositeFieldContainer[ExportLayer]
    compression: str
    media_type: str
    base_image: str
    base_manifest: str
    base_config: bytes
    base_missing: str
    base_digest: str
    def __init__(self, stack: _Optional[str] = ..., branch: _Optional[str] = ..., node: _Optional[str] = ..., manifest: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[ExportLayer, _Mapping]]] = ..., compression: _Optional[str] = ..., media_type: _Optional[str] = ..., base_image: _Optional[str] = ..., base_manifest: _Optional[str] = ..., base_config: _Optional[bytes] = ..., base_missing: _Optional[str] = ..., base_digest: _Optional[str] = ...) -> None: ...

class ExportBlobDone(_message.Message):
    __slots__ = ("index", "digest", "diff_id", "size", "uncompressed_size", "omitted")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DIFF_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_SIZE_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    index: int
    digest: str
    diff_id: str
    size: int
    uncompressed_size: int
    omitted: bool
    def __init__(self, index: _Optional[int] = ..., digest: _Optional[str] = ..., diff_id: _Optional[str] = ..., size: _Optional[int] = ..., uncompressed_size: _Optional[int] = ..., omitted: _Optional[bool] = ...) -> None: ...

class ExportReply(_message.Message):
    __slots__ = ("plan", "chunk", "done")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    plan: ExportPlan
    chunk: bytes
    done: ExportBlobDone
    def __init__(self, plan: _Optional[_Union[ExportPlan, _Mapping]] = ..., chunk: _Optional[bytes] = ..., done: _Optional[_Union[ExportBlobDone, _Mapping]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("namespace", "stack", "branch", "node", "name", "idempotency_key", "policy", "wait_ms", "ignore_mtime", "sandbox", "wasi")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_MTIME_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    WASI_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    branch: str
    node: str
    name: str
    idempotency_key: str
    policy: str
    wait_ms: int
    ignore_mtime: bool
    sandbox: SandboxOptions
    wasi: WasiOptions
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., node: _Optional[str] = ..., name: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., policy: _Optional[str] = ..., wait_ms: _Optional[int] = ..., ignore_mtime: _Optional[bool] = ..., sandbox: _Optional[_Union[SandboxOptions, _Mapping]] = ..., wasi: _Optional[_Union[WasiOptions, _Mapping]] = ...) -> None: ...

class WasiOptions(_message.Message):
    __slots__ = ("fuel", "memory_bytes", "deadline_ms", "env", "output_bytes")
    FUEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    fuel: int
    memory_bytes: int
    deadline_ms: int
    env: _containers.RepeatedScalarFieldContainer[str]
    output_bytes: int
    def __init__(self, fuel: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., env: _Optional[_Iterable[str]] = ..., output_bytes: _Optional[int] = ...) -> None: ...

class SandboxOptions(_message.Message):
    __slots__ = ("network", "has_user", "uid", "gid", "workdir", "env", "placement", "hostname", "cpu_millis", "memory_bytes", "pids", "id_map")
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    HAS_USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    ID_MAP_FIELD_NUMBER: _ClassVar[int]
    network: bool
    has_user: bool
    uid: int
    gid: int
    workdir: str
    env: _containers.RepeatedScalarFieldContainer[str]
    placement: str
    hostname: str
    cpu_millis: int
    memory_bytes: int
    pids: int
    id_map: IdMap
    def __init__(self, network: _Optional[bool] = ..., has_user: _Optional[bool] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., workdir: _Optional[str] = ..., env: _Optional[_Iterable[str]] = ..., placement: _Optional[str] = ..., hostname: _Optional[str] = ..., cpu_millis: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., id_map: _Optional[_Union[IdMap, _Mapping]] = ...) -> None: ...

class IdMap(_message.Message):
    __slots__ = ("host_uid", "host_gid", "size")
    HOST_UID_FIELD_NUMBER: _ClassVar[int]
    HOST_GID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    host_uid: int
    host_gid: int
    size: int
    def __init__(self, host_uid: _Optional[int] = ..., host_gid: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("session_id", "argv", "env", "cwd", "has_user", "uid", "gid", "stdin", "timeout_ms", "module")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    HAS_USER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    has_user: bool
    uid: int
    gid: int
    stdin: bytes
    timeout_ms: int
    module: bytes
    def __init__(self, session_id: _Optional[int] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., has_user: _Optional[bool] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., stdin: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ..., module: _Optional[bytes] = ...) -> None: ...

class ExecReply(_message.Message):
    __slots__ = ("stdout", "stderr", "exit")
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    stdout: bytes
    stderr: bytes
    exit: ExecExit
    def __init__(self, stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[ExecExit, _Mapping]] = ...) -> None: ...

class ExecExit(_message.Message):
    __slots__ = ("code", "signal", "timed_out", "duration_ms", "oom_killed", "session_memory_peak_bytes", "session_cpu_usec", "trap", "trap_message", "fuel_used", "module_digest", "module_compiled", "stdout_truncated", "stderr_truncated", "start_failed")
    CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    SESSION_MEMORY_PEAK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_CPU_USEC_FIELD_NUMBER: _ClassVar[int]
    TRAP_FIELD_NUMBER: _ClassVar[int]
    TRAP_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FUEL_USED_FIELD_NUMBER: _ClassVar[int]
    MODULE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODULE_COMPILED_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    START_FAILED_FIELD_NUMBER: _ClassVar[int]
    code: int
    signal: int
    timed_out: bool
    duration_ms: int
    oom_killed: bool
    session_memory_peak_bytes: int
    session_cpu_usec: int
    trap: str
    trap_message: str
    fuel_used: int
    module_digest: str
    module_compiled: bool
    stdout_truncated: bool
    stderr_truncated: bool
    start_failed: bool
    def __init__(self, code: _Optional[int] = ..., signal: _Optional[int] = ..., timed_out: _Optional[bool] = ..., duration_ms: _Optional[int] = ..., oom_killed: _Optional[bool] = ..., session_memory_peak_bytes: _Optional[int] = ..., session_cpu_usec: _Optional[int] = ..., trap: _Optional[str] = ..., trap_message: _Optional[str] = ..., fuel_used: _Optional[int] = ..., module_digest: _Optional[str] = ..., module_compiled: _Optional[bool] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., start_failed: _Optional[bool] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "offset", "limit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    offset: int
    limit: int
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WriteFileHeader(_message.Message):
    __slots__ = ("session_id", "path", "mode", "make_parents", "has_owner", "uid", "gid", "has_mode")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAKE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    HAS_OWNER_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    HAS_MODE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    mode: int
    make_parents: bool
    has_owner: bool
    uid: int
    gid: int
    has_mode: bool
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ..., mode: _Optional[int] = ..., make_parents: _Optional[bool] = ..., has_owner: _Optional[bool] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., has_mode: _Optional[bool] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WriteFileHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WriteFileHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("session_id", "path")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class FileStat(_message.Message):
    __slots__ = ("name", "raw_name", "kind", "size", "mode", "uid", "gid", "mtime_ns", "link_target")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RAW_NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    MTIME_NS_FIELD_NUMBER: _ClassVar[int]
    LINK_TARGET_FIELD_NUMBER: _ClassVar[int]
    name: str
    raw_name: bytes
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    link_target: str
    def __init__(self, name: _Optional[str] = ..., raw_name: _Optional[bytes] = ..., kind: _Optional[str] = ..., size: _Optional[int] = ..., mode: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., mtime_ns: _Optional[int] = ..., link_target: _Optional[str] = ...) -> None: ...

class ListDirResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FileStat]
    def __init__(self, entries: _Optional[_Iterable[_Union[FileStat, _Mapping]]] = ...) -> None: ...

class StatPathRequest(_message.Message):
    __slots__ = ("session_id", "path")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class RemovePathRequest(_message.Message):
    __slots__ = ("session_id", "path", "recursive")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    recursive: bool
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ..., recursive: _Optional[bool] = ...) -> None: ...

class RemovePathResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class UploadTarRequest(_message.Message):
    __slots__ = ("session_id", "path", "make_parents", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAKE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    make_parents: bool
    data: bytes
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ..., make_parents: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadTarResponse(_message.Message):
    __slots__ = ("files", "dirs", "symlinks", "hardlinks", "bytes")
    FILES_FIELD_NUMBER: _ClassVar[int]
    DIRS_FIELD_NUMBER: _ClassVar[int]
    SYMLINKS_FIELD_NUMBER: _ClassVar[int]
    HARDLINKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    files: int
    dirs: int
    symlinks: int
    hardlinks: int
    bytes: int
    def __init__(self, files: _Optional[int] = ..., dirs: _Optional[int] = ..., symlinks: _Optional[int] = ..., hardlinks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class DownloadTarRequest(_message.Message):
    __slots__ = ("session_id", "path")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    path: str
    def __init__(self, session_id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session", "mounts", "created")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    session: Session
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    created: bool
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., created: _Optional[bool] = ...) -> None: ...

class RunSessionRequest(_message.Message):
    __slots__ = ("create", "exec", "close")
    CREATE_FIELD_NUMBER: _ClassVar[int]
    EXEC_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    create: CreateSessionRequest
    exec: ExecRequest
    close: CloseSessionRequest
    def __init__(self, create: _Optional[_Union[CreateSessionRequest, _Mapping]] = ..., exec: _Optional[_Union[ExecRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSessionRequest, _Mapping]] = ...) -> None: ...

class RunSessionReply(_message.Message):
    __slots__ = ("session", "stdout", "stderr", "exit", "closed")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session: CreateSessionResponse
    stdout: bytes
    stderr: bytes
    exit: ExecExit
    closed: Session
    def __init__(self, session: _Optional[_Union[CreateSessionResponse, _Mapping]] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., exit: _Optional[_Union[ExecExit, _Mapping]] = ..., closed: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "action", "reason", "has_exit_status", "exit_status", "state", "command", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    action: EndAction
    reason: str
    has_exit_status: bool
    exit_status: int
    state: str
    command: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[int] = ..., action: _Optional[_Union[EndAction, str]] = ..., reason: _Optional[str] = ..., has_exit_status: _Optional[bool] = ..., exit_status: _Optional[int] = ..., state: _Optional[str] = ..., command: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces", "page_size", "page_token", "owner_kind")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNER_KIND_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all_namespaces: bool
    page_size: int
    page_token: str
    owner_kind: str
    def __init__(self, namespace: _Optional[str] = ..., all_namespaces: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., owner_kind: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ConflictPath(_message.Message):
    __slots__ = ("path", "reason")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    path: str
    reason: str
    def __init__(self, path: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PathCounts(_message.Message):
    __slots__ = ("clean", "merged", "conflict", "excluded")
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    CONFLICT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    clean: int
    merged: int
    conflict: int
    excluded: int
    def __init__(self, clean: _Optional[int] = ..., merged: _Optional[int] = ..., conflict: _Optional[int] = ..., excluded: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "namespace", "container", "key", "stack", "branch", "state", "outcome", "conflicts", "layer", "message", "released", "run", "paths", "dry_run", "timings", "owner_kind", "owner", "outcome_id", "counts", "conflicts_truncated", "policy", "node", "interrupted_by", "daemon_owned", "limits", "branch_created", "id_map")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    OWNER_KIND_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    CONFLICTS_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_BY_FIELD_NUMBER: _ClassVar[int]
    DAEMON_OWNED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_CREATED_FIELD_NUMBER: _ClassVar[int]
    ID_MAP_FIELD_NUMBER: _ClassVar[int]
    id: int
    namespace: str
    container: str
    key: str
    stack: str
    branch: str
    state: str
    outcome: str
    conflicts: _containers.RepeatedCompositeFieldContainer[ConflictPath]
    layer: int
    message: str
    released: bool
    run: int
    paths: _containers.RepeatedCompositeFieldContainer[PathVerdict]
    dry_run: bool
    timings: PublishTimings
    owner_kind: str
    owner: str
    outcome_id: int
    counts: PathCounts
    conflicts_truncated: bool
    policy: str
    node: str
    interrupted_by: str
    daemon_owned: bool
    limits: SandboxLimits
    branch_created: bool
    id_map: IdMap
    def __init__(self, id: _Optional[int] = ..., namespace: _Optional[str] = ..., container: _Optional[str] = ..., key: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., state: _Optional[str] = ..., outcome: _Optional[str] = ..., conflicts: _Optional[_Iterable[_Union[ConflictPath, _Mapping]]] = ..., layer: _Optional[int] = ..., message: _Optional[str] = ..., released: _Optional[bool] = ..., run: _Optional[int] = ..., paths: _Optional[_Iterable[_Union[PathVerdict, _Mapping]]] = ..., dry_run: _Optional[bool] = ..., timings: _Optional[_Union[PublishTimings, _Mapping]] = ..., owner_kind: _Optional[str] = ..., owner: _Optional[str] = ..., outcome_id: _Optional[int] = ..., counts: _Optional[_Union[PathCounts, _Mapping]] = ..., conflicts_truncated: _Optional[bool] = ..., policy: _Optional[str] = ..., node: _Optional[str] = ..., interrupted_by: _Optional[str] = ..., daemon_owned: _Optional[bool] = ..., limits: _Optional[_Union[SandboxLimits, _Mapping]] = ..., branch_created: _Optional[bool] = ..., id_map: _Optional[_Union[IdMap, _Mapping]] = ...) -> None: ...

class SandboxLimits(_message.Message):
    __slots__ = ("cpu_millis", "memory_bytes", "pids", "network")
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    cpu_millis: int
    memory_bytes: int
    pids: int
    network: bool
    def __init__(self, cpu_millis: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., network: _Optional[bool] = ...) -> None: ...

class PathVerdict(_message.Message):
    __slots__ = ("path", "status", "reason", "raw_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RAW_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    status: str
    reason: str
    raw_path: bytes
    def __init__(self, path: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., raw_path: _Optional[bytes] = ...) -> None: ...

class PublishTimings(_message.Message):
    __slots__ = ("capture_us", "gate_wait_us", "gate_hold_us", "total_us", "capture_bytes")
    CAPTURE_US_FIELD_NUMBER: _ClassVar[int]
    GATE_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    GATE_HOLD_US_FIELD_NUMBER: _ClassVar[int]
    TOTAL_US_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    capture_us: int
    gate_wait_us: int
    gate_hold_us: int
    total_us: int
    capture_bytes: int
    def __init__(self, capture_us: _Optional[int] = ..., gate_wait_us: _Optional[int] = ..., gate_hold_us: _Optional[int] = ..., total_us: _Optional[int] = ..., capture_bytes: _Optional[int] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("namespace", "container", "timeout_ms", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    timeout_ms: int
    session_id: int
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., session_id: _Optional[int] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("namespace", "container", "action", "reason", "has_exit_status", "exit_status", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    action: EndAction
    reason: str
    has_exit_status: bool
    exit_status: int
    session_id: int
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., action: _Optional[_Union[EndAction, str]] = ..., reason: _Optional[str] = ..., has_exit_status: _Optional[bool] = ..., exit_status: _Optional[int] = ..., session_id: _Optional[int] = ...) -> None: ...

class DryRunReply(_message.Message):
    __slots__ = ("session", "paths")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    paths: _containers.RepeatedCompositeFieldContainer[PathVerdict]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., paths: _Optional[_Iterable[_Union[PathVerdict, _Mapping]]] = ...) -> None: ...

class ListOutcomePathsRequest(_message.Message):
    __slots__ = ("outcome_id", "status", "page_size", "page_token")
    OUTCOME_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    outcome_id: int
    status: str
    page_size: int
    page_token: str
    def __init__(self, outcome_id: _Optional[int] = ..., status: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListOutcomePathsResponse(_message.Message):
    __slots__ = ("paths", "next_page_token")
    PATHS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedCompositeFieldContainer[PathVerdict]
    next_page_token: str
    def __init__(self, paths: _Optional[_Iterable[_Union[PathVerdict, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("namespace", "container", "policy")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    policy: str
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class LogRequest(_message.Message):
    __slots__ = ("namespace", "image", "branch", "paths")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    image: str
    branch: str
    paths: bool
    def __init__(self, namespace: _Optional[str] = ..., image: _Optional[str] = ..., branch: _Optional[str] = ..., paths: _Optional[bool] = ...) -> None: ...

class LogReply(_message.Message):
    __slots__ = ("stack", "branch", "entry", "more")
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    stack: str
    branch: str
    entry: LogEntry
    more: LogPaths
    def __init__(self, stack: _Optional[str] = ..., branch: _Optional[str] = ..., entry: _Optional[_Union[LogEntry, _Mapping]] = ..., more: _Optional[_Union[LogPaths, _Mapping]] = ...) -> None: ...

class LogPaths(_message.Message):
    __slots__ = ("layer", "changed")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    layer: int
    changed: _containers.RepeatedCompositeFieldContainer[PathChange]
    def __init__(self, layer: _Optional[int] = ..., changed: _Optional[_Iterable[_Union[PathChange, _Mapping]]] = ...) -> None: ...

class PathChange(_message.Message):
    __slots__ = ("path", "kind", "raw_path")
    PATH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RAW_PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    kind: str
    raw_path: bytes
    def __init__(self, path: _Optional[str] = ..., kind: _Optional[str] = ..., raw_path: _Optional[bytes] = ...) -> None: ...

class LogEntry(_message.Message):
    __slots__ = ("layer", "manifest", "session", "namespace", "container", "paths", "created_ns", "kind", "owner", "changed", "members")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    manifest: int
    session: int
    namespace: str
    container: str
    paths: int
    created_ns: int
    kind: str
    owner: str
    changed: _containers.RepeatedCompositeFieldContainer[PathChange]
    members: _containers.RepeatedCompositeFieldContainer[LogEntry]
    def __init__(self, layer: _Optional[int] = ..., manifest: _Optional[int] = ..., session: _Optional[int] = ..., namespace: _Optional[str] = ..., container: _Optional[str] = ..., paths: _Optional[int] = ..., created_ns: _Optional[int] = ..., kind: _Optional[str] = ..., owner: _Optional[str] = ..., changed: _Optional[_Iterable[_Union[PathChange, _Mapping]]] = ..., members: _Optional[_Iterable[_Union[LogEntry, _Mapping]]] = ...) -> None: ...

class SetBranchRequest(_message.Message):
    __slots__ = ("namespace", "container", "branch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    branch: str
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., branch: _Optional[str] = ...) -> None: ...

class Mount(_message.Message):
    __slots__ = ("type", "source", "options")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    type: str
    source: str
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, type: _Optional[str] = ..., source: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class SetBranchResponse(_message.Message):
    __slots__ = ("session", "changed", "mounts")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    changed: bool
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., changed: _Optional[bool] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "root", "containerd_address", "events_subscribed", "default_branch", "pid", "metrics_address", "mount_address", "sandbox_sessions", "sandbox_max_sessions", "executors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BRANCH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MOUNT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    version: str
    root: str
    containerd_address: str
    events_subscribed: bool
    default_branch: str
    pid: int
    metrics_address: str
    mount_address: str
    sandbox_sessions: int
    sandbox_max_sessions: int
    executors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., root: _Optional[str] = ..., containerd_address: _Optional[str] = ..., events_subscribed: _Optional[bool] = ..., default_branch: _Optional[str] = ..., pid: _Optional[int] = ..., metrics_address: _Optional[str] = ..., mount_address: _Optional[str] = ..., sandbox_sessions: _Optional[int] = ..., sandbox_max_sessions: _Optional[int] = ..., executors: _Optional[_Iterable[str]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("stack", "name", "head", "depth", "updated_ns")
    STACK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    UPDATED_NS_FIELD_NUMBER: _ClassVar[int]
    stack: str
    name: str
    head: int
    depth: int
    updated_ns: int
    def __init__(self, stack: _Optional[str] = ..., name: _Optional[str] = ..., head: _Optional[int] = ..., depth: _Optional[int] = ..., updated_ns: _Optional[int] = ...) -> None: ...

class Stack(_message.Message):
    __slots__ = ("id", "namespace", "base_digest", "image_refs", "branches", "base_layers", "layers", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    IMAGE_REFS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    BASE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    namespace: str
    base_digest: str
    image_refs: _containers.RepeatedScalarFieldContainer[str]
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    base_layers: int
    layers: int
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., namespace: _Optional[str] = ..., base_digest: _Optional[str] = ..., image_refs: _Optional[_Iterable[str]] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., base_layers: _Optional[int] = ..., layers: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class ListStacksRequest(_message.Message):
    __slots__ = ("namespace", "all_namespaces", "usage", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all_namespaces: bool
    usage: bool
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., all_namespaces: _Optional[bool] = ..., usage: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListStacksResponse(_message.Message):
    __slots__ = ("stacks", "next_page_token")
    STACKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    stacks: _containers.RepeatedCompositeFieldContainer[Stack]
    next_page_token: str
    def __init__(self, stacks: _Optional[_Iterable[_Union[Stack, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RemoveStackRequest(_message.Message):
    __slots__ = ("namespace", "stack", "force")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    force: bool
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ListBranchesRequest(_message.Message):
    __slots__ = ("namespace", "stack", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBranchesResponse(_message.Message):
    __slots__ = ("stack", "branches", "next_page_token")
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    stack: str
    branches: _containers.RepeatedCompositeFieldContainer[Branch]
    next_page_token: str
    def __init__(self, stack: _Optional[str] = ..., branches: _Optional[_Iterable[_Union[Branch, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CreateBranchRequest(_message.Message):
    __slots__ = ("namespace", "stack", "name", "at_layer", "at_base")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    AT_LAYER_FIELD_NUMBER: _ClassVar[int]
    AT_BASE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    name: str
    at_layer: int
    at_base: bool
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., name: _Optional[str] = ..., at_layer: _Optional[int] = ..., at_base: _Optional[bool] = ..., **kwargs) -> None: ...

class DeleteBranchRequest(_message.Message):
    __slots__ = ("namespace", "stack", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DeleteBranchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("namespace", "stack", "to", "operation")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    to: str
    operation: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., to: _Optional[str] = ..., operation: _Optional[str] = ..., **kwargs) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("result", "head", "session", "message")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    result: str
    head: int
    session: Session
    message: str
    def __init__(self, result: _Optional[str] = ..., head: _Optional[int] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class SquashRequest(_message.Message):
    __slots__ = ("namespace", "stack", "branch")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    branch: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ...) -> None: ...

class SquashResponse(_message.Message):
    __slots__ = ("squashed", "layer", "head", "depth_before", "depth_after")
    SQUASHED_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    DEPTH_BEFORE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_AFTER_FIELD_NUMBER: _ClassVar[int]
    squashed: bool
    layer: int
    head: int
    depth_before: int
    depth_after: int
    def __init__(self, squashed: _Optional[bool] = ..., layer: _Optional[int] = ..., head: _Optional[int] = ..., depth_before: _Optional[int] = ..., depth_after: _Optional[int] = ...) -> None: ...

class GcRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GcResponse(_message.Message):
    __slots__ = ("layers", "manifests", "bytes_freed", "uppers_released")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    UPPERS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    layers: int
    manifests: int
    bytes_freed: int
    uppers_released: int
    def __init__(self, layers: _Optional[int] = ..., manifests: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., uppers_released: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("hot", "cold", "uppers", "staging", "metadata", "snapshots", "total")
    HOT_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    UPPERS_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    hot: int
    cold: int
    uppers: int
    staging: int
    metadata: int
    snapshots: int
    total: int
    def __init__(self, hot: _Optional[int] = ..., cold: _Optional[int] = ..., uppers: _Optional[int] = ..., staging: _Optional[int] = ..., metadata: _Optional[int] = ..., snapshots: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class DiskUsageRequest(_message.Message):
    __slots__ = ("namespace", "stack")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ...) -> None: ...

class StackUsage(_message.Message):
    __slots__ = ("stack", "usage")
    STACK_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    stack: str
    usage: Usage
    def __init__(self, stack: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class DiskUsageResponse(_message.Message):
    __slots__ = ("total", "stacks")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    total: Usage
    stacks: _containers.RepeatedCompositeFieldContainer[StackUsage]
    def __init__(self, total: _Optional[_Union[Usage, _Mapping]] = ..., stacks: _Optional[_Iterable[_Union[StackUsage, _Mapping]]] = ...) -> None: ...

class BlameRequest(_message.Message):
    __slots__ = ("namespace", "stack", "branch", "path")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    branch: str
    path: bytes
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., path: _Optional[bytes] = ...) -> None: ...

class BlameRange(_message.Message):
    __slots__ = ("start", "end", "owner", "session")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    owner: str
    session: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., owner: _Optional[str] = ..., session: _Optional[int] = ...) -> None: ...

class BlameResponse(_message.Message):
    __slots__ = ("stack", "branch", "manifest", "path", "digest", "lines", "layer", "layer_kind", "ranges")
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LAYER_KIND_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    stack: str
    branch: str
    manifest: int
    path: str
    digest: str
    lines: int
    layer: int
    layer_kind: str
    ranges: _containers.RepeatedCompositeFieldContainer[BlameRange]
    def __init__(self, stack: _Optional[str] = ..., branch: _Optional[str] = ..., manifest: _Optional[int] = ..., path: _Optional[str] = ..., digest: _Optional[str] = ..., lines: _Optional[int] = ..., layer: _Optional[int] = ..., layer_kind: _Optional[str] = ..., ranges: _Optional[_Iterable[_Union[BlameRange, _Mapping]]] = ...) -> None: ...

class DiffRequest(_message.Message):
    __slots__ = ("namespace", "stack", "to", "at_layer", "session_id", "container", "patch", "at_base")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    AT_LAYER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    AT_BASE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    to: str
    at_layer: int
    session_id: int
    container: str
    patch: bool
    at_base: bool
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., to: _Optional[str] = ..., at_layer: _Optional[int] = ..., session_id: _Optional[int] = ..., container: _Optional[str] = ..., patch: _Optional[bool] = ..., at_base: _Optional[bool] = ..., **kwargs) -> None: ...

class DiffEntry(_message.Message):
    __slots__ = ("path", "raw_path", "change", "old_kind", "new_kind", "old_size", "new_size", "old_mode", "new_mode", "patch")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RAW_PATH_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    OLD_KIND_FIELD_NUMBER: _ClassVar[int]
    NEW_KIND_FIELD_NUMBER: _ClassVar[int]
    OLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEW_SIZE_FIELD_NUMBER: _ClassVar[int]
    OLD_MODE_FIELD_NUMBER: _ClassVar[int]
    NEW_MODE_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    path: str
    raw_path: bytes
    change: str
    old_kind: str
    new_kind: str
    old_size: int
    new_size: int
    old_mode: int
    new_mode: int
    patch: str
    def __init__(self, path: _Optional[str] = ..., raw_path: _Optional[bytes] = ..., change: _Optional[str] = ..., old_kind: _Optional[str] = ..., new_kind: _Optional[str] = ..., old_size: _Optional[int] = ..., new_size: _Optional[int] = ..., old_mode: _Optional[int] = ..., new_mode: _Optional[int] = ..., patch: _Optional[str] = ...) -> None: ...

class DiffReply(_message.Message):
    __slots__ = ("old", "new", "entries")
    OLD_FIELD_NUMBER: _ClassVar[int]
    NEW_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    old: str
    new: str
    entries: _containers.RepeatedCompositeFieldContainer[DiffEntry]
    def __init__(self, old: _Optional[str] = ..., new: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[DiffEntry, _Mapping]]] = ...) -> None: ...

class ShowConflictsRequest(_message.Message):
    __slots__ = ("namespace", "container", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    session_id: int
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class ConflictEntry(_message.Message):
    __slots__ = ("path", "raw_path", "reason", "text", "blocks", "note")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RAW_PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    path: str
    raw_path: bytes
    reason: str
    text: bytes
    blocks: int
    note: str
    def __init__(self, path: _Optional[str] = ..., raw_path: _Optional[bytes] = ..., reason: _Optional[str] = ..., text: _Optional[bytes] = ..., blocks: _Optional[int] = ..., note: _Optional[str] = ...) -> None: ...

class ConflictsReply(_message.Message):
    __slots__ = ("session", "entries")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    session: Session
    entries: _containers.RepeatedCompositeFieldContainer[ConflictEntry]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., entries: _Optional[_Iterable[_Union[ConflictEntry, _Mapping]]] = ...) -> None: ...

class RebaseSessionRequest(_message.Message):
    __slots__ = ("namespace", "container", "session_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    session_id: int
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., session_id: _Optional[int] = ...) -> None: ...

class MarkedPath(_message.Message):
    __slots__ = ("path", "blocks")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    path: str
    blocks: int
    def __init__(self, path: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class RebaseSessionResponse(_message.Message):
    __slots__ = ("session", "head", "merged", "marked")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    MARKED_FIELD_NUMBER: _ClassVar[int]
    session: Session
    head: int
    merged: _containers.RepeatedScalarFieldContainer[str]
    marked: _containers.RepeatedCompositeFieldContainer[MarkedPath]
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., head: _Optional[int] = ..., merged: _Optional[_Iterable[str]] = ..., marked: _Optional[_Iterable[_Union[MarkedPath, _Mapping]]] = ...) -> None: ...

class GraphGroup(_message.Message):
    __slots__ = ("name", "stack", "branch", "root", "created_ns")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    stack: str
    branch: str
    root: str
    created_ns: int
    def __init__(self, name: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., root: _Optional[str] = ..., created_ns: _Optional[int] = ...) -> None: ...

class Node(_message.Message):
    __slots__ = ("id", "group", "kind", "manifest", "state", "parents", "attempt", "command", "labels", "has_exit_status", "exit_status", "private_bytes", "base_digest", "pruned", "created_ns", "missing_parents", "declared_parents")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRUNED_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    MISSING_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_PARENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    group: str
    kind: str
    manifest: int
    state: str
    parents: _containers.RepeatedScalarFieldContainer[str]
    attempt: int
    command: str
    labels: _containers.ScalarMap[str, str]
    has_exit_status: bool
    exit_status: int
    private_bytes: int
    base_digest: str
    pruned: bool
    created_ns: int
    missing_parents: _containers.RepeatedScalarFieldContainer[str]
    declared_parents: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., group: _Optional[str] = ..., kind: _Optional[str] = ..., manifest: _Optional[int] = ..., state: _Optional[str] = ..., parents: _Optional[_Iterable[str]] = ..., attempt: _Optional[int] = ..., command: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., has_exit_status: _Optional[bool] = ..., exit_status: _Optional[int] = ..., private_bytes: _Optional[int] = ..., base_digest: _Optional[str] = ..., pruned: _Optional[bool] = ..., created_ns: _Optional[int] = ..., missing_parents: _Optional[_Iterable[str]] = ..., declared_parents: _Optional[_Iterable[str]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("id", "node", "session", "status", "key", "result_node", "message", "created_ns", "ended_ns")
    ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    RESULT_NODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    ENDED_NS_FIELD_NUMBER: _ClassVar[int]
    id: int
    node: str
    session: int
    status: str
    key: str
    result_node: str
    message: str
    created_ns: int
    ended_ns: int
    def __init__(self, id: _Optional[int] = ..., node: _Optional[str] = ..., session: _Optional[int] = ..., status: _Optional[str] = ..., key: _Optional[str] = ..., result_node: _Optional[str] = ..., message: _Optional[str] = ..., created_ns: _Optional[int] = ..., ended_ns: _Optional[int] = ...) -> None: ...

class Graph(_message.Message):
    __slots__ = ("group", "nodes", "attempts")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    group: GraphGroup
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    def __init__(self, group: _Optional[_Union[GraphGroup, _Mapping]] = ..., nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ...) -> None: ...

class CreateGraphRequest(_message.Message):
    __slots__ = ("namespace", "stack", "branch", "name", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    stack: str
    branch: str
    name: str
    key: str
    def __init__(self, namespace: _Optional[str] = ..., stack: _Optional[str] = ..., branch: _Optional[str] = ..., name: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class ListGraphsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListGraphsResponse(_message.Message):
    __slots__ = ("graphs", "next_page_token")
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    graphs: _containers.RepeatedCompositeFieldContainer[GraphGroup]
    next_page_token: str
    def __init__(self, graphs: _Optional[_Iterable[_Union[GraphGroup, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ShowGraphRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ShowNodeRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class StartAttemptRequest(_message.Message):
    __slots__ = ("node", "owner", "key", "policy")
    NODE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    node: str
    owner: str
    key: str
    policy: str
    def __init__(self, node: _Optional[str] = ..., owner: _Optional[str] = ..., key: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class RetryAttemptRequest(_message.Message):
    __slots__ = ("attempt", "owner", "key", "policy")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    owner: str
    key: str
    policy: str
    def __init__(self, attempt: _Optional[int] = ..., owner: _Optional[str] = ..., key: _Optional[str] = ..., policy: _Optional[str] = ...) -> None: ...

class AttemptResponse(_message.Message):
    __slots__ = ("attempt", "session", "mounts", "created")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    attempt: Attempt
    session: Session
    mounts: _containers.RepeatedCompositeFieldContainer[Mount]
    created: bool
    def __init__(self, attempt: _Optional[_Union[Attempt, _Mapping]] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., mounts: _Optional[_Iterable[_Union[Mount, _Mapping]]] = ..., created: _Optional[bool] = ...) -> None: ...

class ListAttemptsRequest(_message.Message):
    __slots__ = ("node", "page_size", "page_token")
    NODE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node: str
    page_size: int
    page_token: str
    def __init__(self, node: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAttemptsResponse(_message.Message):
    __slots__ = ("attempts", "next_page_token")
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    next_page_token: str
    def __init__(self, attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "container", "state", "command", "has_exit_status", "exit_status", "key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    HAS_EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    namespace: str
    container: str
    state: str
    command: str
    has_exit_status: bool
    exit_status: int
    key: str
    def __init__(self, session_id: _Optional[int] = ..., namespace: _Optional[str] = ..., container: _Optional[str] = ..., state: _Optional[str] = ..., command: _Optional[str] = ..., has_exit_status: _Optional[bool] = ..., exit_status: _Optional[int] = ..., key: _Optional[str] = ...) -> None: ...

class MergeNodesRequest(_message.Message):
    __slots__ = ("a", "b", "state", "key")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    state: str
    key: str
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., state: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class MergeNodesResponse(_message.Message):
    __slots__ = ("node", "session")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    node: Node
    session: Session
    def __init__(self, node: _Optional[_Union[Node, _Mapping]] = ..., session: _Optional[_Union[Session, _Mapping]] = ...) -> None: ...

class PromoteNodeRequest(_message.Message):
    __slots__ = ("node", "branch", "key", "stack", "namespace")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    node: str
    branch: str
    key: str
    stack: str
    namespace: str
    def __init__(self, node: _Optional[str] = ..., branch: _Optional[str] = ..., key: _Optional[str] = ..., stack: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class PruneNodeRequest(_message.Message):
    __slots__ = ("node", "key")
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    node: str
    key: str
    def __init__(self, node: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class PruneNodeResponse(_message.Message):
    __slots__ = ("pruned",)
    PRUNED_FIELD_NUMBER: _ClassVar[int]
    pruned: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pruned: _Optional[_Iterable[str]] = ...) -> None: ...

class SetNodeRequest(_message.Message):
    __slots__ = ("namespace", "container", "node", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    container: str
    node: str
    key: str
    def __init__(self, namespace: _Optional[str] = ..., container: _Optional[str] = ..., node: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...
