"""Wire messages between hub and generators (the codec, with its bounds, is pipeline/codec.py).

Every message is a small typed dataclass; nested structs (`PromptItem`, `Sample`, `Sampling`, ...) have no
tag of their own. Bulk arrays (token ids, log-probs) are raw little-endian bytes: int32 token ids, float32
log-probs. Within a schema version fields are only ever appended, with defaults, so an older peer's message
still decodes. What a message *says* (token ids in the vocabulary, finite numbers, versions, whose lease) is
checked by the hub (hub/validation.py).

Control channel (generator DEALER -> hub ROUTER), request -> reply:
    SpecRequest -> RunSpec | Error       (before registering: the run's config for what a generator serves)
    Register -> Welcome | Error          Heartbeat -> HeartbeatReply      LeaseRequest -> Lease | Wait | RunComplete
    WeightsApplied -> Ack                WeightsFetch -> WeightsChunk     GroupFailed -> Ack      Leave -> Ack
    StatusRequest -> StatusReply (operator)                                SetRequest -> SetReply (operator)
The hub also pushes, unasked (request id 0): WeightsReady, the one route by which a version reaches a generator.
Rollouts channel (generator PUSH -> hub PULL): RolloutGroup, one per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.codec import (  # noqa: F401  (the codec is used through this module: P.encode, P.decode, ...)
    DEFAULT_MAX_STR,
    FROM_HUB,
    FROM_PEER,
    SCHEMA_VERSION,
    Limits,
    Message,
    ProtocolError,
    SchemaMismatch,
    as_dict,
    decode,
    encode,
    from_dict,
    pack_floats,
    pack_ints,
    pack_mask,
    text,
    unpack_floats,
    unpack_ints,
    unpack_mask,
)

MAX_CONTROL_BYTES = FROM_PEER.bytes
MAX_PARTS = 16  # samples one trajectory may be split into (an agent's re-rendered histories: generator/agent.py)
GENERATOR_ID = 128  # characters of a generator id


class PeerLost(ConnectionError):
    """The other side stopped answering (no reply within the handshake timeout or heartbeats missed)."""


# ---- nested structs (no tag of their own) -------------------------------------------------------


@dataclass
class PromptItem:
    prompt_id: int
    epoch: int
    prompt: str = text(2**24)
    columns: dict = field(default_factory=dict)
    prompt_ids: bytes = b""  # int32: the prompt as the learner tokenised it; the generator generates from these
    messages: list = field(default_factory=list)  # conversational prompts (TRL's format): [{"role", "content"}, ...]


@dataclass
class Sample:
    token_ids: bytes  # int32 little-endian
    logprobs: bytes  # float32 little-endian, one per token: behaviour log-probs from vLLM
    reward: float
    rewards: list[float] = field(default_factory=list)  # one per reward function, unweighted
    finish_reason: str = text(32, "")
    first_version: int = 0  # weights version that produced the first token
    last_version: int = 0  # weights version that produced the last token
    gen_ms: float = 0.0
    mask: bytes = b""  # uint8 per token: 1 sampled by the model (trained), 0 put there by the environment; "": all 1
    # an agent's samples (generator/agent.py): a trajectory whose context stopped extending what came before (its
    # history re-rendered or edited) goes on as another sample of the same trajectory, with the context it came from
    prompt_ids: bytes = b""  # int32: this sample's own context; "": the group's prompt
    trajectory: int = -1  # the group's trajectory it belongs to (whose reward it carries); -1: its own index
    turns: bytes = b""  # int32 pairs: where each model turn starts in token_ids, the weights version that sampled it


@dataclass
class Sampling:
    """How a lease's prompts are sampled (`sampling.*` of the run as the hub has it when it grants the lease)."""

    max_tokens: int
    temperature: float
    top_p: float = 1.0
    ignore_eos: bool = False


@dataclass
class CollectiveSetup:
    """nccl transport: where and how this generator's workers meet the learner (weights/nccl.py)."""

    port: int
    world_size: int
    backend: str = text(16)
    timeout_s: float = 120.0


@dataclass
class GeneratorStatus:
    id: str = text(GENERATOR_ID)
    host: str = text(255)
    gpus: str = text(128)
    version: int = -1
    lag: int = -1  # learner version - its version (-1: it holds no weights of this run yet)
    tokens_per_s: float = 0.0
    leases: int = 0
    groups: int = 0
    tokens: int = 0
    last_heartbeat_s: float = 0.0
    transport: str = text(16, "")
    draining: bool = False
    adapter_slots: int = 0  # generator.lora_mode adapter: adapters its engine serves at once (0: merged)


# ---- control channel: generator -> hub ----------------------------------------------------------


@dataclass
class Register(Message):
    tag: ClassVar[str] = "register"
    generator_id: str = text(GENERATOR_ID)
    host: str = text(255, "")
    boot_id: str = text(64, "")  # where it runs: pipeline.host.host_identity ("BOOT_ID:NETNS:SHM"; older: the boot id)
    gpus: str = text(128, "")
    pid: int = 0
    loaded_version: int = -1  # >= 0 when reconnecting with an engine that already holds weights
    tensor_parallel: int = 1  # workers of this generator (ranks of its nccl process group, besides the learner)
    session: str = text(64, "")  # re-registering under the same id: the session its last Welcome gave it
    loaded_run: str = text(256, "")  # the run id of the weights its engine holds ("": the model from disk)
    spec_digest: str = text(64, "")  # pipeline.runspec.digest of the config it serves: the run's, adopted (RunSpec)
    fingerprints: dict[str, str] = field(default_factory=dict)  # of the model files on its host (pipeline/fingerprint)
    adapter_slots: int = 0  # generator.lora_mode adapter: adapters its engine serves at once (vLLM's max_loras)
    contents: dict[str, str] = field(default_factory=dict)  # of the code and files its config names (pipeline/pinning)


@dataclass
class SpecRequest(Message):
    """Before registering (and each time again): the run's config for what a generator serves and scores (RunSpec).
    `claims`: the values its own config sets explicitly (dotted key -> value); `fingerprints`: of the model files on
    its host, once it knows them; `problem`: why it cannot serve the run (no such model on its host, an engine that
    did not start). A claim or fingerprint that differs from the run's, or a problem, is refused (Error.stop), naming
    the field, and counted (hub counter refused_spec). pipeline/runspec.py."""

    tag: ClassVar[str] = "spec_request"
    generator_id: str = text(GENERATOR_ID)
    claims: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    problem: str = text(16384, "")


@dataclass
class Heartbeat(Message):
    tag: ClassVar[str] = "heartbeat"
    generator_id: str = text(GENERATOR_ID)
    version: int = 0
    tokens_per_s: float = 0.0
    inflight_groups: int = 0
    lease_ids: list[int] = field(default_factory=list)  # every lease it holds (received, not yet finished)
    draining: bool = False  # finishing its groups before it leaves: it takes no more broadcasts
    pushed: int = 0  # rollouts sent in this session: until the hub has them all, an unlisted lease may be in flight
    # tokens its engine generated so far (finished groups and requests still running): a count that stops moving
    # while it holds leases is a hung engine, and the hub takes them back (hub.progress_timeout_s)
    generated: int = 0
    # seconds spent in each of STAGES since it started (pipeline/trace.py): metrics.jsonl records what they gained
    # during each learner step (gen/<stage>_s)
    stage_s: dict = field(default_factory=dict)


# a generator's stages (Heartbeat.stage_s): lease round trips, waits for room in the window (engine_full: while its
# engine held as many sequences as it runs at once) and for a lease's weights version, time with groups generating
# and with none, scoring, encoding, sending, loading weights
STAGES = ("lease", "wait_room", "engine_full", "wait_version", "generating", "idle", "score", "encode", "send",
          "weights")


@dataclass
class LeaseRequest(Message):
    tag: ClassVar[str] = "lease_request"
    generator_id: str = text(GENERATOR_ID)
    max_groups: int = 1


@dataclass
class WeightsApplied(Message):
    tag: ClassVar[str] = "weights_applied"
    generator_id: str = field(metadata={"max_len": GENERATOR_ID})  # required: mypy reads text() as a default
    version: int
    load_ms: float = 0.0
    via: str = text(16, "")  # the transport that delivered it


@dataclass
class GroupFailed(Message):
    """A leased prompt's group could not be generated; `kind` says whose fault: "engine" (lease it again),
    "prompt" (vLLM refused the prompt itself), "reward" (a reward function raised: `reason` holds the function
    and its traceback; an error of the run, not of the prompt), "agent" (an agent hung or failed under
    generator.agent_failure requeue: lease it again), "stale" (the generator stopped it: its samples started under a
    version more than trainer.max_staleness behind the newest it loaded, so no step can train it; lease it again)."""

    tag: ClassVar[str] = "group_failed"
    generator_id: str = field(metadata={"max_len": GENERATOR_ID})  # required: mypy reads text() as a default
    lease_id: int
    epoch: int
    prompt_id: int
    reason: str = text(16384, "")
    kind: str = text(16, "engine")


@dataclass
class WeightsFetch(Message):
    tag: ClassVar[str] = "weights_fetch"
    version: int
    offset: int
    length: int
    generator_id: str = text(GENERATOR_ID, "")  # only registered generators are served
    delta: bool = False  # the delta from FileVersion.delta_base, not the full blob


@dataclass
class Leave(Message):
    tag: ClassVar[str] = "leave"
    generator_id: str = text(GENERATOR_ID)
    returned_leases: list[int] = field(default_factory=list)
    reason: str = text(16384, "")  # why it leaves when it is not asked to (its engine died: the engine's error)
    pushed: int = 0  # rollouts it sent in this session: the hub waits for those still on their way (another socket)


@dataclass
class StatusRequest(Message):
    tag: ClassVar[str] = "status_request"


@dataclass
class SetRequest(Message):
    tag: ClassVar[str] = "set_request"
    key: str = text(128)
    value: Any = None


# ---- control channel: hub -> generator ----------------------------------------------------------


@dataclass
class RunSpec(Message):
    """The run's values of what a generator serves (pipeline.runspec.SERVED: {dotted prefix: value}), the digest a
    Register must show, the fingerprints of the learner's model files, and the content digests of the code and files
    the config names (pipeline/pinning.py: {dotted field: sha256}), which a generator's must equal."""

    tag: ClassVar[str] = "run_spec"
    run_id: str
    config: dict[str, Any]
    digest: str = text(64)
    fingerprints: dict[str, str] = field(default_factory=dict)
    contents: dict[str, str] = field(default_factory=dict)


@dataclass
class Welcome(Message):
    tag: ClassVar[str] = "welcome"
    run_id: str
    generator_id: str
    version: int
    rollouts_endpoint: str
    transport: str
    heartbeat_s: float
    sampling: Sampling
    group_size: int = 2
    index: int = 0  # registration order, for per-generator seeds
    collective: CollectiveSetup | None = None  # nccl transport only
    session: str = text(64, "")  # a secret of this registration: its rollouts carry it, a re-registration shows it


@dataclass
class Lease(Message):
    tag: ClassVar[str] = "lease"
    lease_id: int
    min_version: int
    groups: list[PromptItem]
    sampling: Sampling
    group_size: int = 0  # samples per prompt; 0: the run's (Welcome.group_size)
    eval: bool = False  # an evaluation lease: scored by the hub, not trained


@dataclass
class Wait(Message):
    tag: ClassVar[str] = "wait"
    reason: str = text(4096)
    retry_s: float = 0.05


@dataclass
class RunComplete(Message):
    """No more leases: the learner trained its last step. Generators apply `version` (announced) and leave."""

    tag: ClassVar[str] = "run_complete"
    version: int


@dataclass
class HeartbeatReply(Message):
    tag: ClassVar[str] = "heartbeat_reply"
    version: int  # the learner's
    dead_leases: list[int] = field(default_factory=list)  # leases the generator holds that the hub took back
    max_staleness: int = -1  # trainer.max_staleness now (`pipeline set`): adapter slots follow it


@dataclass
class WeightsChunk(Message):
    tag: ClassVar[str] = "weights_chunk"
    version: int
    offset: int
    data: bytes
    total: int


@dataclass
class Ack(Message):
    tag: ClassVar[str] = "ack"
    known: bool = True  # GroupFailed: False when the hub no longer had that prompt's lease


@dataclass
class StatusReply(Message):
    tag: ClassVar[str] = "status_reply"
    run_id: str
    version: int
    max_staleness: int
    batch_size: int
    buffer: int
    in_flight: int
    pending: int
    trained: int
    counters: dict[str, int]
    failure: str = text(65536, "")
    authenticated: bool = False
    generators: list[GeneratorStatus] = field(default_factory=list)
    verdict: str = text(2048, "")  # what holds the run back, the learner's latest word (pipeline/verdict.py)


@dataclass
class SetReply(Message):
    tag: ClassVar[str] = "set_reply"
    key: str = text(128)
    value: Any = None
    from_step: int = 0


@dataclass
class Error(Message):
    tag: ClassVar[str] = "error"
    message: str = text(65536)
    fatal: bool = False  # the peer must re-register (e.g. unknown generator id after a learner restart)
    stop: bool = False  # the peer must leave and exit: the run failed, or it is refused (the message says why)
    gone: bool = False  # WeightsFetch: the version is no longer served; the generator takes the newest announced


# ---- rollouts and weight announcements ----------------------------------------------------------


@dataclass
class RolloutGroup(Message):
    tag: ClassVar[str] = "rollout_group"
    lease_id: int
    generator_id: str = field(metadata={"max_len": GENERATOR_ID})  # required: mypy reads text() as a default
    prompt_id: int
    epoch: int
    prompt_ids: bytes  # int32 little-endian
    samples: list[Sample]
    temperature: float = 1.0  # sampling temperature the behaviour log-probs were computed at
    session: str = text(64, "")  # the session of the generator's registration (Welcome.session)


@dataclass
class FileVersion:
    """A version as one safetensors blob (the file transports, zmq and shm)."""

    size: int
    checksum: int  # crc32 of the blob
    shm_path: str = text(4096, "")  # set when the learner wrote the blob to /dev/shm (shm transport)
    delta_base: int = -1  # weights.delta: a delta from this version is served too (weights/delta.py)
    delta_size: int = 0
    delta_checksum: int = 0  # crc32 of the delta


@dataclass
class IpcBuffer:
    """One of the learner's shared buckets (the ipc transport): torch's CUDA IPC handle of its storage."""

    handle: bytes
    size: int  # bytes of the storage
    offset: int  # of the storage in its CUDA allocation
    ref_handle: bytes  # torch's reference count of the storage across processes
    ref_offset: int
    event: bytes
    event_sync: bool


@dataclass
class IpcHandles:
    """The learner's shared buckets on its GPU, one per bucket of the manifest (weights/ipc.py)."""

    uuid: str = text(64)  # of the learner's GPU
    buffers: list[IpcBuffer] = field(default_factory=list)


@dataclass
class WeightsReady(Message):
    """A new weights version: pushed by the hub on a generator's control connection (the one route)."""

    tag: ClassVar[str] = "weights_ready"
    version: int
    published_at: float = 0.0  # learner's time.time() at the end of the optimizer step
    file: FileVersion | None = None  # file transports: the blob to fetch
    manifest: list = field(default_factory=list)  # nccl, ipc: [[name, dtype, shape], ...], the buckets' layout
    ipc: IpcHandles | None = None  # ipc: the buffers holding this version


def trajectory_of(samples: list) -> list[int]:
    """Each sample's trajectory in its group (an agent's trajectory may be split into several samples): of Samples,
    or of the generator's Trajectory objects, which carry `trajectory` the same way."""
    return [s.trajectory if s.trajectory >= 0 else i for i, s in enumerate(samples)]


def trajectory_rewards(samples: list[Sample]) -> list[float]:
    """The reward of each trajectory of a group, in order (its samples share it)."""
    first: dict[int, float] = {}
    for t, s in zip(trajectory_of(samples), samples, strict=True):
        first.setdefault(t, s.reward)
    return [first[t] for t in sorted(first)]


def check_shape(group: RolloutGroup, group_size: int) -> None:
    """Validate array sizes of a decoded RolloutGroup (types are already checked by `decode`)."""
    where = f"RolloutGroup(prompt_id={group.prompt_id})"
    if len(group.prompt_ids) % 4 or not group.prompt_ids:
        raise ProtocolError(f"{where}.prompt_ids: {len(group.prompt_ids)} bytes is not a non-empty int32 array")
    owners = trajectory_of(group.samples)
    if sorted(set(owners)) != list(range(group_size)) or len(owners) > group_size * MAX_PARTS:
        raise ProtocolError(f"{where}.samples: {len(group.samples)} samples of trajectories {sorted(set(owners))[:8]}, "
                            f"the run's group size is {group_size} (each trajectory 0..{group_size - 1}, at most "
                            f"{MAX_PARTS} samples each)")
    for i, s in enumerate(group.samples):
        if len(s.token_ids) % 4 or len(s.token_ids) != len(s.logprobs):
            raise ProtocolError(
                f"{where}.samples[{i}]: token_ids ({len(s.token_ids)} bytes) and logprobs ({len(s.logprobs)} bytes) "
                "must be int32/float32 arrays of one length"
            )
        if s.mask and (len(s.mask) != len(s.token_ids) // 4 or max(s.mask) > 1):
            raise ProtocolError(f"{where}.samples[{i}].mask: {len(s.mask)} bytes for {len(s.token_ids) // 4} tokens; "
                                "one 0 or 1 per token")
        if s.first_version > s.last_version:
            raise ProtocolError(
                f"{where}.samples[{i}]: first_version {s.first_version} > last_version {s.last_version}")
        if len(s.prompt_ids) % 4 or len(s.turns) % 8:
            raise ProtocolError(f"{where}.samples[{i}]: prompt_ids ({len(s.prompt_ids)} bytes) must be an int32 array, "
                                f"turns ({len(s.turns)} bytes) int32 pairs")
