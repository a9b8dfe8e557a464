"""The shm transport: on the learner's host the generator reads the file the learner wrote to /dev/shm.

No socket copy. The learner's side is the file sender (weights/files.py `FileSender`, shared with zmq), which
writes each version to /dev/shm while a generator uses shm; a version that was not written there (published
before this generator registered, or already removed as old) is pulled over zmq instead.
"""

from __future__ import annotations

from pathlib import Path

from pipeline import protocol as P
from weights.files import verify_file
from weights.zmq import ZmqReceiver


class ShmReceiver(ZmqReceiver):
    name = "shm"

    async def fetch(self, ready: P.WeightsReady) -> str:
        path = ready.file.shm_path
        if not path or not Path(path).exists():
            self.via = "zmq"
            return await super().fetch(ready)
        self.via = self.name
        return await verify_file(path, ready)
