"""How a weights version gets from the learner into the generators' engines: one strategy per transport.

    transport  learner side (a sender)                 generator side (a receiver)
    zmq        files.FileSender: a blob the hub serves  zmq.ZmqReceiver: pulls the blob in chunks (any host)
    shm        files.FileSender: the blob in /dev/shm   shm.ShmReceiver: reads the learner's file (same host)
    nccl       nccl.NcclSender: broadcasts from the     nccl.NcclReceiver, and generator/worker_ext.py inside vLLM's
               learner's GPU (gloo on CPU)              workers
    ipc        ipc.IpcSender: buckets shared over CUDA  ipc.IpcReceiver: the engine's workers copy them into the
               IPC on the learner's GPU                 weights (a generator on the learner's own GPU)
What a version is made of (manifest, buckets, the safetensors blob) is weights/plan.py, which both sides use.
The hub picks a generator's transport once, at registration (`pick`), and names it in the Welcome; the
generator builds the receiver of that name (`receiver`). A version reaches a generator by one route: a
WeightsReady the hub pushes on the generator's control connection (`file` for the file transports, a
`manifest` for nccl, with the buffers' handles for ipc).

A sender (learner/publisher.py drives it; rank 0 only):
    available() -> bool                      (static) usable here, for `weights.transport: auto`
    join(register, ident, version)           a generator of this transport registers (hub thread, hub lock held):
                                             its setup for the Welcome (P.CollectiveSetup) or None
    leave(generator_id, again)               it drains, leaves, or registers again
    begin(version, manifest, published_at)   a version is being gathered: True to get its buckets as they are packed
    bucket(flat)                             one packed bucket (on `device`, None: wherever the learner packs)
    end()                                    after the version's last bucket, or when its publishing failed: release
                                             what begin took (called on every sender whose begin returned True)
    wanted() -> bool                         wants the version's CPU copy: `send` runs in the background
    send(version, named, published_at)
    on_applied(generator_id, version)        a generator applied a version (hub thread, hub lock held)
    metrics() -> dict                        of the last version
    shutdown()                               the run ends: release what lives outside the process
    transports                               set by `senders`: the transports it serves
    latest                                   set by the publisher: latest(fn, background=False) calls
                                             fn(version, named) with the newest version's CPU copy (late joiners)
A receiver's `apply` that raises `VersionGone` skips that version: a newer one is, or will be, announced (the
generator goes on with it, in the same session); any other error makes the generator register again.
Adding a transport: its sender, its receiver, its line in TRANSPORTS, and its name among the choices of
`weights.transport` (pipeline/config.py); `auto` picks among ipc, nccl, shm and zmq (`pick`).
"""

from __future__ import annotations

import importlib


class VersionGone(Exception):
    """The announced version can no longer be had (a newer one replaced it before it was read): skip it, take the
    newest announced. Not a reason to register again."""


TRANSPORTS = {  # name: (the learner's sender, the generator's receiver); senders of one class are one object
    "zmq": ("weights.files:FileSender", "weights.zmq:ZmqReceiver"),
    "shm": ("weights.files:FileSender", "weights.shm:ShmReceiver"),
    "nccl": ("weights.nccl:NcclSender", "weights.nccl:NcclReceiver"),
    "ipc": ("weights.ipc:IpcSender", "weights.ipc:IpcReceiver"),
}


def _load(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def senders(cfg, hub, run_id: str) -> dict:
    """The learner's senders by transport: the configured one's, or with `auto` every one available here."""
    names = list(TRANSPORTS) if cfg.weights.transport == "auto" else [cfg.weights.transport]
    made, out = {}, {}
    for name in names:
        cls = _load(TRANSPORTS[name][0])
        if cfg.weights.transport == "auto" and not cls.available():
            continue
        if cls not in made:
            made[cls] = cls(cfg, hub, run_id)
            made[cls].transports = set()
        out[name] = made[cls]
        out[name].transports.add(name)
    return out


def receiver(transport: str, client, chunk_mb: int, generator_id: str):
    """The generator's receiver for the transport its Welcome names."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weights.transport: {transport!r} is not available here ({', '.join(TRANSPORTS)})")
    return _load(TRANSPORTS[transport][1])(client, chunk_mb * 2**20, generator_id)


def pick(configured: str, register, learner_host: str, learner_gpus: list[str], senders: dict) -> str:
    """The transport of a registering generator. `auto`: ipc for a one-GPU generator on the learner's own GPU;
    nccl when the learner has a collective transport (GPUs) and the generator reports GPUs other than the
    learner's; else shm on the learner's host, zmq across hosts. A generator that failed ipc or nccl once is
    not given it again. `learner_host` and `register.boot_id` are pipeline.host.host_identity's: a generator in
    another network namespace of the learner's machine is on another host (shm and ipc need one host), though
    its GPU numbers are the learner's (one machine)."""
    if configured != "auto":
        return configured
    same_host = bool(register.boot_id) and register.boot_id == learner_host
    # the boot id alone (an older generator reports nothing else): one machine, whose GPU numbers are the learner's
    same_machine = bool(register.boot_id) and register.boot_id.split(":")[0] == learner_host.split(":")[0]
    shares_gpu = same_machine and bool(set(register.gpus.split(",")) & set(learner_gpus))
    ipc = senders.get("ipc")
    if (ipc is not None and same_host and register.gpus == learner_gpus[0] and register.tensor_parallel == 1
            and register.generator_id not in ipc.failed):
        return "ipc"
    nccl = senders.get("nccl")
    if nccl is not None and register.gpus and not shares_gpu and register.generator_id not in nccl.failed:
        return "nccl"
    return "shm" if same_host else "zmq"
