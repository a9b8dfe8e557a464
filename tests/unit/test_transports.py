"""Weight transports on the generator side: files are verified against the announcement."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, load_file, save

from pipeline import protocol as P
from weights.files import ChecksumMismatch, remove_shm, serialize_to_shm, write_shm
from weights.plan import checksum, serialize
from weights.shm import ShmReceiver
from weights.zmq import ZmqReceiver


def ready(version: int, size: int, crc: int, path: str = "") -> P.WeightsReady:
    return P.WeightsReady(version, file=P.FileVersion(size, crc, path))


@pytest.fixture
def zmq_pulls(monkeypatch) -> list[int]:
    """The shm receiver's fallback, the zmq pull, recorded instead of done."""
    pulls = []

    async def fetch(self, ready):
        pulls.append(ready.version)
        return "via-zmq"

    monkeypatch.setattr(ZmqReceiver, "fetch", fetch)
    return pulls


def test_serialize_writes_a_safetensors_blob_of_every_dtype_and_layout():
    """The blob is read back by safetensors itself, tensor for tensor: dtypes, a 0-d and an empty tensor, a
    transposed (non-contiguous) one; the same size as safetensors' own writer; an unknown dtype is refused."""
    named = [("b", torch.randn(3, 5).to(torch.bfloat16)), ("a", torch.arange(7)), ("z", torch.zeros(0)),
             ("s", torch.tensor(3.5, dtype=torch.float64)), ("m", torch.tensor([True, False])),
             ("h", torch.randn(4, 6, dtype=torch.float16).t()), ("i", torch.arange(5, dtype=torch.int8))]
    blob = serialize(named)
    back = load(bytes(blob))
    assert sorted(back) == sorted(n for n, _ in named)
    for name, t in named:
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    assert len(blob) == len(save({n: t.contiguous() for n, t in named}))
    with pytest.raises(ValueError, match="c has dtype torch.complex64"):
        serialize([("c", torch.zeros(2, dtype=torch.complex64))])


async def test_shm_file_is_verified_and_corruption_refused(zmq_pulls):
    blob = serialize([("w", torch.arange(1000, dtype=torch.float32))])
    path = write_shm("unit-test", 3, blob)
    try:
        receiver = ShmReceiver(None, 2**20)
        announced = ready(3, len(blob), checksum(blob), path)
        got = await receiver.fetch(announced)  # the receiver's own name of the learner's file
        assert os.path.samefile(got, path) and got != path and receiver.via == "shm"
        assert torch.equal(load_file(path)["w"], torch.arange(1000, dtype=torch.float32))
        with pytest.raises(ChecksumMismatch, match="announced"):
            await receiver.fetch(ready(3, len(blob), checksum(blob) ^ 1, path))
        with open(path, "r+b") as f:  # a flipped byte in the file
            f.seek(len(blob) - 1)
            f.write(b"\x01" if blob[-1:] != b"\x01" else b"\x02")
        with pytest.raises(ChecksumMismatch):
            await receiver.fetch(announced)
        assert zmq_pulls == []
    finally:
        remove_shm("unit-test")


async def test_shm_falls_back_to_zmq_for_versions_not_in_shared_memory(zmq_pulls):
    receiver = ShmReceiver(None, 2**20)
    assert await receiver.fetch(ready(1, 10, 0, "")) == "via-zmq"
    assert await receiver.fetch(ready(2, 10, 0, "/dev/shm/pipeline-gone/weights-v2.safetensors")) == "via-zmq"
    assert zmq_pulls == [1, 2]
    assert receiver.via == "zmq"  # what the generator reports in its weights_applied event


def test_a_version_serialised_into_shared_memory_is_its_blob_and_outlives_the_files_removal():
    """serialize_to_shm writes the blob straight into the file: the same bytes as serialize, read back by
    safetensors; its memory map still serves zmq pulls once the file of an old version is removed."""
    named = [("b", torch.randn(3, 5).to(torch.bfloat16)), ("a", torch.arange(7)),
             ("h", torch.randn(4, 6, dtype=torch.float16).t())]
    try:
        path, blob = serialize_to_shm("unit-ser", 3, named)
        assert bytes(blob) == bytes(serialize(named)) and Path(path).read_bytes() == bytes(blob)
        back = load_file(path)
        assert all(torch.equal(back[n], t) for n, t in named)
        assert not list(Path(path).parent.glob("*.tmp"))
        serialize_to_shm("unit-ser", 5, named)  # keeps the newest two: 3 goes
        assert not Path(path).exists() and bytes(blob) == bytes(serialize(named))
        assert checksum(blob) == checksum(serialize(named))
    finally:
        remove_shm("unit-ser")


def test_the_checksum_summed_in_segments_is_zlibs_crc32(monkeypatch):
    import os
    import zlib

    import weights.plan

    for segment in (1, 7, 4096):  # segments of every size, the last one short
        monkeypatch.setattr(weights.plan, "CRC_SEGMENT", segment)
        for n in (0, 1, segment, 3 * segment + 5, 50 * segment + 3):
            data = os.urandom(n)
            assert checksum(data) == zlib.crc32(data), (segment, n)
            assert checksum(bytearray(data)) == zlib.crc32(data)
    assert weights.plan.crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b""), 0) == zlib.crc32(b"ab")


def test_old_versions_are_removed_from_shared_memory():
    blob = serialize([("w", torch.zeros(4))])
    try:
        paths = [write_shm("unit-test2", v, blob) for v in range(4)]
        import os

        assert [os.path.exists(p) for p in paths] == [False, False, True, True]  # keeps the newest two
    finally:
        remove_shm("unit-test2")


def test_weight_files_are_private_and_stale_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from pipeline import host
    from weights.files import remove_shm, write_shm

    monkeypatch.setattr(host, "SHM_ROOT", tmp_path)
    monkeypatch.setattr(host.tempfile, "gettempdir", lambda: str(tmp_path))
    path = Path(write_shm("run-x", 3, b"weights"))
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = host.private_dir(tmp_path / "pipeline-recv-stale")
    (stale / "owner").write_text(dead.stdout.strip())  # a generator killed with SIGKILL left it
    (stale / "weights-v1.safetensors").write_bytes(b"x")
    foreign = tmp_path / "pipeline-not-ours"  # no owner file: not made by this code, left alone
    foreign.mkdir()
    for name in ("psm_0000aaaa", "psm_1234abcd", "psm_5678ef01", "sem.mp-k3x_9q2a"):  # one another process's
        (tmp_path / name).write_bytes(b"segment")
    engines = ["psm_1234abcd", "psm_5678ef01", "sem.mp-k3x_9q2a"]  # own_segments: tests/unit/test_generator_segments.py
    assert host.record_segments(engines) == engines
    recv = host.receiver_dir()
    (recv / "owner").write_text(dead.stdout.strip())  # its generator and engine were killed with SIGKILL
    pid = int(dead.stdout)
    ipc_dead = [tmp_path / f"torch_{pid}_2601234328_0", tmp_path / f"cuda.shm.0.{pid:x}.1"]  # a killed learner's
    me = os.getpid()
    ipc_live = [tmp_path / f"torch_{me}_77_0", tmp_path / f"cuda.shm.0.{me:x}.1", tmp_path / "torch_x"]
    for f in ipc_dead + ipc_live:
        f.write_bytes(b"")
    assert sorted(host.remove_stale()) == sorted([stale, recv, *ipc_dead])
    assert all(f.exists() for f in ipc_live)
    assert sorted(p.name for p in tmp_path.iterdir() if host.SEGMENT.fullmatch(p.name)) == ["psm_0000aaaa"]
    assert not stale.exists() and foreign.exists() and path.exists()  # the live process's folder stays
    assert int((path.parent / "owner").read_text()) == os.getpid()
    remove_shm("run-x")
    assert not path.parent.exists()


def test_a_folder_whose_owner_exited_unreaped_is_removed(tmp_path, monkeypatch):
    """An owner that exited but is a zombie still (its parent, often init once its own parent is gone, has not reaped
    it yet) is gone: a guard no longer waits for init to reap before it sweeps."""
    import subprocess
    import sys

    from pipeline import host
    from tests.conftest import running, wait_for

    monkeypatch.setattr(host, "SHM_ROOT", tmp_path)
    monkeypatch.setattr(host.tempfile, "gettempdir", lambda: str(tmp_path))
    exited = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie once it ends
    try:
        wait_for(lambda: Path(f"/proc/{exited.pid}").exists() and not running(exited.pid), 60, "the child to exit")
        left = host.private_dir(tmp_path / "pipeline-recv-zombie")
        (left / "owner").write_text(str(exited.pid))
        assert host.remove_stale() == [left] and not left.exists()
    finally:
        exited.wait()


def test_a_delta_round_trips_across_chunks_and_refuses_another_layout(monkeypatch):
    import struct

    import numpy as np

    from weights import delta

    monkeypatch.setattr(delta, "CHUNK", 1000)  # several chunks, the last one short
    header = b'{"w":{"dtype":"BF16","shape":[2500],"data_offsets":[0,5000]}}'
    base = struct.pack("<Q", len(header)) + header + np.random.default_rng(0).bytes(5000)
    new = bytearray(base)
    new[100], new[2999], new[-1] = new[100] ^ 1, new[2999] ^ 4, new[-1] ^ 8  # three changed bytes, three chunks
    diff = delta.encode(base, bytes(new))
    assert delta.apply(base, diff).tobytes() == bytes(new) and len(diff) < len(base) // 4
    assert delta.encode(base, base[:8] + header.replace(b"2500", b"2501") + base[8 + len(header):]) is None
    with pytest.raises(ValueError, match="chunks"):
        delta.apply(base, diff[:-1])  # truncated
    with pytest.raises(ValueError, match="chunks"):
        delta.apply(base + b"\0" * 1000, diff)  # another base


def test_a_version_being_pulled_is_served_until_its_pull_ends_and_older_pulls_are_bounded():
    """zmq: a pull slower than two learner steps keeps its version (it would otherwise lose it halfway, every
    time); at most PULLED_MAX such older versions are kept, and a generator whose version goes is told plainly that
    it cannot keep up; a version not being pulled goes as before."""
    from weights import zmq as Z

    blobs = Z.Blobs(4)

    def fetch(gen, version, offset=0):
        return blobs.chunk(P.WeightsFetch(version, offset, 4, gen), gen, blobs.newest)

    blobs.put(1, b"v1-blob-")
    assert isinstance(fetch("slow", 1), P.WeightsChunk)  # its pull of v1 begins
    for v in (2, 3, 4):
        blobs.put(v, f"v{v}-blob-".encode())
    assert fetch("slow", 1, 4).data == b"lob-"  # the rest of v1, two learner steps later
    assert sorted(blobs.by_version) == [1, 3, 4]
    gone = fetch("late", 2)  # nobody pulled v2: it went as before
    assert isinstance(gone, P.Error) and gone.gone and Z.GONE in gone.message and "keep up" not in gone.message
    blobs.done("slow")  # it applied v1
    assert sorted(blobs.by_version) == [3, 4]

    for gen, v in (("a", 5), ("b", 6), ("c", 7)):  # three slow pulls of three versions
        blobs.put(v, b"blob")
        assert isinstance(fetch(gen, v), P.WeightsChunk)
    blobs.put(8, b"blob")
    blobs.put(9, b"blob")
    assert sorted(blobs.by_version) == [6, 7, 8, 9]  # the newest two, and the newest PULLED_MAX pulled
    cut = fetch("a", 5)
    assert isinstance(cut, P.Error) and cut.gone and "cannot keep up" in cut.message
    assert isinstance(fetch("b", 6), P.WeightsChunk)
    blobs.put(10, b"blob")  # b moves on to a newer version: the one it pulled before is not kept for it
    assert isinstance(fetch("b", 10), P.WeightsChunk) and sorted(blobs.by_version) == [7, 9, 10]


async def test_a_pull_of_a_version_no_longer_served_raises_version_gone_and_writes_nothing_after():
    """The receiver takes "no longer served" as VersionGone (the generator moves to the newest, same session), and
    the chunks still in flight stop before the file is closed."""
    from pipeline.host import remove_receiver_dir
    from weights import VersionGone
    from weights import zmq as Z

    blob = serialize([("w", torch.arange(5000, dtype=torch.float32))])
    blobs = Z.Blobs(4096)
    blobs.put(1, blob)
    asked = []

    class Client:
        async def request(self, msg, timeout=None):
            asked.append(msg.offset)
            if msg.offset == 4096:  # the hub dropped it meanwhile
                await asyncio.sleep(0.01)
                return P.Error(f"weights version 1 {Z.GONE} (latest: 3)", gone=True)
            if msg.offset >= 8192:  # in flight when it failed: answered long after, unless cancelled
                await asyncio.sleep(0.3)
            return blobs.chunk(msg, "g", blobs.newest)

    receiver = ZmqReceiver(Client(), 4096, "g", window=2)
    try:
        with pytest.raises(VersionGone, match="no longer served"):
            await receiver.fetch(ready(1, len(blob), checksum(blob)))
        # 0 came back, 4096 failed, 8192 and then 12288 took the two places in flight; the last chunk never does
        assert asked == [0, 4096, 8192, 12288] and len(blob) > 16384
        await asyncio.sleep(0.6)
        assert asked == [0, 4096, 8192, 12288]  # nothing more asked once it failed: those in flight were cancelled
        assert not list(receiver.dir.glob("weights-v*"))  # no part of a blob left to pass for a delta's base
    finally:
        remove_receiver_dir()


class LoadingEngine:
    """Loads the path it is given the way a vLLM worker does: opens it again, after `before_open` ran."""

    def __init__(self, before_open=lambda: None):
        self.before_open, self.loaded = before_open, []

    async def swap(self, version, method, source, crc32):
        assert method == "load_weights_blob"
        self.before_open()
        self.loaded.append((version, load_file(source)["w"].clone()))
        return 1.0


async def test_an_shm_version_removed_by_the_learner_while_it_loads_is_still_loaded():
    """The learner keeps the newest two versions in /dev/shm: two more published between the generator's check
    and its worker's open removed the file ("No such file or directory", and the generator registered again).
    The receiver's own link keeps it readable until loaded, and is removed afterwards."""
    from pipeline.host import receiver_dir, remove_receiver_dir

    named = [("w", torch.arange(1000, dtype=torch.float32))]
    blob = serialize(named)
    path = write_shm("unit-race", 1, blob)
    engine = LoadingEngine(lambda: [write_shm("unit-race", v, blob) for v in (2, 3)])
    try:
        receiver = ShmReceiver(None, 2**20)
        await receiver.apply(ready(1, len(blob), checksum(blob), path), engine)
        assert not Path(path).exists()  # the learner removed it while the engine loaded it
        assert engine.loaded[0][0] == 1 and torch.equal(engine.loaded[0][1], named[0][1])
        assert receiver.via == "shm" and not list(receiver_dir().glob("shm-v*"))  # the link went after the load
    finally:
        remove_shm("unit-race")
        remove_receiver_dir()


async def test_an_shm_version_gone_before_it_is_read_is_version_gone_not_an_error():
    """Removed before the receiver could link it, and no longer served for zmq either: VersionGone (take the
    newest), never an error that makes the generator register again."""
    from pipeline.host import remove_receiver_dir
    from weights import VersionGone
    from weights import zmq as Z

    blobs = Z.Blobs(2**20)
    for v in (1, 2, 3):
        blobs.put(v, b"blob")

    class Client:
        async def request(self, msg, timeout=None):
            return blobs.chunk(msg, "g", blobs.newest)

    receiver = ShmReceiver(Client(), 2**20, "g")
    try:
        with pytest.raises(VersionGone):
            await receiver.apply(ready(1, 4, 0, "/dev/shm/pipeline-unit-gone/weights-v1.safetensors"), LoadingEngine())
    finally:
        remove_receiver_dir()


def test_shm_only_on_the_learners_host_and_a_network_namespace_is_another_host():
    """`auto` gives shm only to a generator on the learner's host: the same boot id, network namespace and /dev/shm.
    One in another network namespace of the same machine (a container; the hosts of tests/integration/test_hosts.py)
    shared the boot id and was given shm; it gets zmq, and its GPU numbers still name the learner's GPUs."""
    from pipeline.host import host_identity
    from weights import pick

    here = host_identity()[1]
    boot, _, shm = here.split(":")
    nccl = {"nccl": SimpleNamespace(failed=set())}

    def auto(where: str, gpus: str = "", senders=None) -> str:
        register = SimpleNamespace(boot_id=where, gpus=gpus, generator_id="g", tensor_parallel=1)
        return pick("auto", register, here, ["0"], senders or {})

    assert auto(here) == "shm"
    assert auto(f"{boot}:1:{shm}") == "zmq"  # another network namespace
    assert auto(boot) == "zmq"  # an older generator: its boot id alone
    assert auto(f"{boot}:1:{shm}", "0", nccl) == "zmq"  # the learner's own GPU, seen from another namespace
    assert auto(f"{boot}:1:{shm}", "1", nccl) == auto("another-boot:1:2", "0", nccl) == "nccl"


def test_a_process_in_another_network_namespace_reports_another_host():
    import subprocess
    import sys

    code = "from pipeline.host import host_identity; print(host_identity()[1])"
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    if out.returncode != 0:
        pytest.skip(f"cannot make a network namespace (root needed): {out.stderr.strip()[-200:]}")
    from pipeline.host import host_identity

    here, there = host_identity()[1], out.stdout.strip()
    assert there != here and there.split(":")[0] == here.split(":")[0]  # one machine, another host


def test_a_generator_on_the_learners_gpu_under_cuda_visible_devices_is_given_ipc(monkeypatch):
    """`CUDA_VISIBLE_DEVICES=1 pipeline run` with the generator on the learner's GPU: the learner's hub compares a
    generator's GPUs with its own CUDA_VISIBLE_DEVICES (1, as the machine numbers it), and the generator reported its
    `--gpus 0` (an index within that set), so `auto` took them for two GPUs and gave nccl, which failed ("Duplicate
    GPU detected") and fell back to shm where ipc was due (an H200, 2026-11-30). It reports the machine's number."""
    from generator.engines import Fixed
    from generator.service import Generator
    from pipeline.config import config_from_dict
    from pipeline.environment import OUTER_GPUS
    from pipeline.host import host_identity
    from weights import pick

    def reported() -> tuple[str, str]:
        gen = Generator(config_from_dict({}), Fixed(object(), object()), "tcp://127.0.0.1:1", "0")
        gen.ctx.destroy(linger=0)
        return gen.gpus, gen.id

    monkeypatch.setenv(OUTER_GPUS, "1")  # as apply_environment leaves a process given --gpus 0 under 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus, generator_id = reported()
    here = host_identity()[1]
    register = SimpleNamespace(boot_id=here, gpus=gpus, generator_id=generator_id, tensor_parallel=1)
    senders = {"ipc": SimpleNamespace(failed=set()), "nccl": SimpleNamespace(failed=set())}
    assert gpus == "1" and pick("auto", register, here, ["1"], senders) == "ipc"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5f1c")  # by UUID: not numbers the hub takes
    assert reported()[0] == "0"
