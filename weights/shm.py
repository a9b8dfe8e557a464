"""The shm transport: on the learner's host the generator reads the file the learner wrote to /dev/shm.

No socket copy. The learner's side is the file sender (weights/files.py `FileSender`, shared with zmq), which
writes each version to /dev/shm while a generator uses shm and keeps the newest two; a version that was not
written there (published before this generator registered, or already removed as old) is pulled over zmq instead.

The learner removes a version's file once two newer ones are out, which can happen while a generator loads it
(checked here, opened again by the vLLM worker). So the receiver first hard-links the learner's file into its own
folder (same tmpfs): that name stays valid until the receiver removes it after the load, whatever the learner
removes meanwhile. A file already gone falls back to the zmq pull, which gives the version or `VersionGone`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline import protocol as P
from pipeline.host import private_dir
from weights.base import Engine
from weights.files import verify_file
from weights.zmq import ZmqReceiver


class ShmReceiver(ZmqReceiver):
    name = "shm"

    async def apply(self, ready: P.WeightsReady, engine: Engine) -> float:
        path = await self.fetch(ready)
        try:
            return await engine.swap(ready.version, "load_weights_blob", path, None)
        finally:
            if self.via == self.name:  # our link, not a pulled file (kept as the next delta's base)
                Path(path).unlink(missing_ok=True)

    async def fetch(self, ready: P.WeightsReady) -> str:
        link = self._link(ready)
        if link is None:
            self.via = "zmq"
            return await super().fetch(ready)
        self.via = self.name
        try:
            return await verify_file(link, ready)
        except BaseException:
            Path(link).unlink(missing_ok=True)
            raise

    def _link(self, ready: P.WeightsReady) -> str | None:
        """A name of the learner's file in this receiver's folder, or None if there is no such file (not written,
        removed already, or another /dev/shm than the learner's)."""
        file = ready.file
        assert file is not None  # accepts() took it
        if not file.shm_path:
            return None
        if not (self.dir / "owner").exists():
            private_dir(self.dir)
        link = self.dir / f"shm-v{ready.version}.safetensors"  # not weights-v*: the zmq pull's files
        link.unlink(missing_ok=True)
        try:
            os.link(file.shm_path, link)
        except OSError:
            return None
        return str(link)
