"""How a weights version gets from the learner into the generators' engines: one strategy per transport.

    transport  learner side                           generator side
    zmq        files.FileSender, zmq.Blobs (the hub)  zmq.ZmqReceiver: pulls the blob in chunks (any host)
    shm        files.FileSender (/dev/shm)            shm.ShmReceiver: reads the learner's file (same host)
    nccl       nccl.CollectivePeers                   nccl.NcclReceiver, and generator/worker_ext.py inside vLLM's
                                                      workers: broadcasts from the learner's GPU (gloo on CPU)
What a version is made of (manifest, buckets, the safetensors blob) is weights/plan.py, which both sides use.
The hub picks a generator's transport once, at registration (`pick`), and names it in the Welcome; the
generator builds the receiver of that name (`receiver`). A version reaches a generator by one route: a
WeightsReady the hub pushes on the generator's control connection (`file` for the file transports, a
`manifest` for nccl). Adding a transport: its sender, its receiver, its line in RECEIVERS.
"""

from __future__ import annotations

RECEIVERS = {
    "zmq": lambda client, chunk_bytes, gen_id: _zmq().ZmqReceiver(client, chunk_bytes, gen_id),
    "shm": lambda client, chunk_bytes, gen_id: _shm().ShmReceiver(client, chunk_bytes, gen_id),
    "nccl": lambda client, chunk_bytes, gen_id: _nccl().NcclReceiver(),
}


def receiver(transport: str, client, chunk_mb: int, generator_id: str):
    """The generator's receiver for the transport its Welcome names."""
    if transport not in RECEIVERS:
        raise ValueError(f"weights.transport: {transport!r} is not available here ({', '.join(RECEIVERS)})")
    return RECEIVERS[transport](client, chunk_mb * 2**20, generator_id)


def pick(configured: str, register, learner_boot_id: str, learner_gpus: list[str], collective) -> str:
    """The transport of a registering generator. `auto`: nccl when the learner has a collective transport (GPUs)
    and the generator reports GPUs other than the learner's (and its group never failed); else shm on the
    learner's host, zmq across hosts."""
    if configured != "auto":
        return configured
    same_host = bool(register.boot_id) and register.boot_id == learner_boot_id
    shares_gpu = same_host and bool(set(register.gpus.split(",")) & set(learner_gpus))
    if collective is not None and register.gpus and not shares_gpu and register.generator_id not in collective.failed:
        return "nccl"
    return "shm" if same_host else "zmq"


def _zmq():
    from weights import zmq

    return zmq


def _shm():
    from weights import shm

    return shm


def _nccl():
    from weights import nccl

    return nccl
