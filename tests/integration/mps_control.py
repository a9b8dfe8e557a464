"""A stand-in for NVIDIA's `nvidia-cuda-mps-control` on machines without its driver (the CPU tests), run through a
script of that name on PATH (`stub_control`). `-f`: the daemon, serving commands on $CUDA_MPS_PIPE_DIRECTORY/control
until `quit`; without it: the client, sending stdin's command there. The daemon writes what it did to
$CUDA_MPS_LOG_DIRECTORY/control.log. MPS_STUB=stuck: the daemon does not quit when told; MPS_STUB=fail: it exits at
once. The real daemon is run by tests/gpu/test_gpu_mps.py."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path


def stub_control(folder: Path) -> Path:
    """A `nvidia-cuda-mps-control` in `folder` that runs this file; put `folder` first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} "$@"\n')
    script.chmod(0o755)
    return folder


def main() -> None:
    pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    control = pipe / "control"
    if sys.argv[1:] != ["-f"]:  # the client: one command
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(control))
            c.sendall(sys.stdin.read().encode())
            print(c.recv(1024).decode(), end="")
        return
    log = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", pipe)) / "control.log"

    def say(line: str) -> None:
        with log.open("a") as f:
            f.write(line + "\n")

    say(f"start pid {os.getpid()} pipe {pipe}")
    if os.environ.get("MPS_STUB") == "fail":
        print("stub: failing at start", file=sys.stderr)
        sys.exit(3)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(control))
        s.listen()
        while True:
            conn, _ = s.accept()
            with conn:
                command = conn.recv(1024).decode().strip()
                say(f"command {command}")
                conn.sendall(b"\n")
            if command == "quit" and os.environ.get("MPS_STUB") != "stuck":
                control.unlink()
                say("quit")
                return


if __name__ == "__main__":
    main()
