"""How a weights version gets from the learner into the generators' engines: one strategy per transport.

    transport  learner side (a sender)                 generator side (a receiver)
    zmq        files.FileSender: a blob the hub serves  zmq.ZmqReceiver: pulls the blob in chunks (any host)
    shm        files.FileSender: the blob in /dev/shm   shm.ShmReceiver: reads the learner's file (same host)
    nccl       nccl.NcclSender: broadcasts from the     nccl.NcclReceiver; in vLLM's workers nccl.CollectiveWorker
               learner's GPU (gloo on CPU)              and the staged receive (staging.py)
    ipc        ipc.IpcSender: buckets shared over CUDA  ipc.IpcReceiver: the engine's workers copy them into the
               IPC on the learner's GPU                 weights (ipc.IpcWorker; a generator on the learner's GPU)
What a version is made of (manifest, buckets, the safetensors blob) is weights/plan.py, which both sides use.
The hub picks a generator's transport once, at registration (`pick`), and names it in the Welcome; the
generator builds the receiver of that name (`receiver`). A version reaches a generator by one route: a
WeightsReady the hub pushes on the generator's control connection (`file` for the file transports, a
`manifest` for nccl, with the buffers' handles for ipc).

A transport is three classes (weights/base.py: Sender, Receiver, Worker, each method a no-op unless the transport
needs it), named on its line of pipeline/transports.py. Adding one is its module and that line; `auto` picks among
ipc, nccl, shm and zmq (`pick`). tests/unit/test_transports.py adds a toy one.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from pipeline.transports import TRANSPORTS

if TYPE_CHECKING:
    from pipeline import protocol as P
    from pipeline.client import HubClient
    from pipeline.config import Config
    from weights.base import Announcer, Receiver, Sender
    from weights.ipc import IpcSender
    from weights.nccl import NcclSender


class VersionGone(Exception):
    """The announced version can no longer be had (a newer one replaced it before it was read): skip it, take the
    newest announced. Not a reason to register again."""


def _load(spec: str) -> Any:  # a class named in pipeline/transports.py
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def senders(cfg: Config, announcer: Announcer, run_id: str) -> dict[str, Sender]:
    """The learner's senders by transport: the configured one's, or with `auto` every one available here."""
    names = list(TRANSPORTS) if cfg.weights.transport == "auto" else [cfg.weights.transport]
    made: dict[type[Sender], Sender] = {}
    out: dict[str, Sender] = {}
    for name in names:
        cls: type[Sender] = _load(TRANSPORTS[name][0])
        if cfg.weights.transport == "auto" and not cls.available():
            continue
        if cls not in made:
            made[cls] = cls(cfg, announcer, run_id)
            made[cls].transports = set()
        out[name] = made[cls]
        out[name].transports.add(name)
    return out


def receiver(transport: str, client: HubClient, chunk_mb: int, generator_id: str) -> Receiver:
    """The generator's receiver for the transport its Welcome names."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weights.transport: {transport!r} is not available here ({', '.join(TRANSPORTS)})")
    return _load(TRANSPORTS[transport][1])(client, chunk_mb * 2**20, generator_id)


def pick(configured: str, register: P.Register, learner_host: str, learner_gpus: list[str],
         senders: dict[str, Sender]) -> str:
    """The transport of a registering generator. `auto`: ipc for a one-GPU generator on the learner's own GPU;
    nccl when the learner has a collective transport (GPUs) and the generator reports GPUs other than the
    learner's; else shm on the learner's host, zmq across hosts. A generator that failed ipc or nccl once is
    not given it again. `learner_host` and `register.boot_id` are pipeline.host.host_identity's: a generator in
    another network namespace of the learner's machine is on another host (shm and ipc need one host), though
    its GPU numbers are the learner's (one machine)."""
    if configured != "auto":
        return configured
    same_host = bool(register.boot_id) and register.boot_id == learner_host
    ipc = cast("IpcSender | None", senders.get("ipc"))
    if (ipc is not None and same_host and register.gpus == learner_gpus[0] and register.tensor_parallel == 1
            and register.generator_id not in ipc.failed):
        return "ipc"
    nccl = cast("NcclSender | None", senders.get("nccl"))
    if (nccl is not None and register.gpus and not shares_gpu(register, learner_host, learner_gpus)
            and register.generator_id not in nccl.failed):
        return "nccl"
    return "shm" if same_host else "zmq"


def shares_gpu(register: P.Register, learner_host: str, learner_gpus: list[str]) -> bool:
    """The generator runs on one of `learner_gpus` of the learner's machine. The boot id alone (an older generator
    reports nothing else) says one machine, whose GPU numbers are the learner's."""
    same_machine = bool(register.boot_id) and register.boot_id.split(":")[0] == learner_host.split(":")[0]
    return same_machine and bool(set(register.gpus.split(",")) & set(learner_gpus))
