"""Several learner ranks: `pipeline learner --gpus 0,1` (or trainer.ranks) on one host runs torchrun's elastic
agent in its own process (torch.distributed.launcher's API, as `torchrun --standalone` does), the path clusters
take with `torchrun --nnodes N` on each node. There is no launcher of our own.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the agent and sees every GPU of
--gpus; it takes the one of its LOCAL_RANK (learner/model.py). The agent passes SIGTERM and SIGINT on to the
ranks, and when one fails it stops the others. A rank ends with the agent that started it (`end_with_parent`),
even after a SIGKILL or the OOM killer: torchrun starts each rank in a session of its own, which a signal to the
agent's process group does not reach.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import tempfile
import uuid

log = logging.getLogger(__name__)


def world_size(ranks: int, gpus: str | None) -> int:
    """This host's learner ranks: trainer.ranks, else one per GPU of --gpus, else 1. Each rank takes the GPU of its
    local rank, so more ranks than GPUs given (--gpus, else those visible) is refused with both numbers (ConfigError);
    without GPUs the ranks are gloo ranks on the CPU, as many as asked."""
    given = len(gpus.split(",")) if gpus else 0
    if ranks > 1 and not given:
        given = _visible_gpus()
    if ranks and given and ranks > given:
        from pipeline.config import ConfigError

        where = f"--gpus {gpus}" if gpus else "the GPUs visible (CUDA_VISIBLE_DEVICES, or all)"
        raise ConfigError(f"trainer.ranks: {ranks} learner ranks, but {where} gives {given} GPU"
                          f"{'s' if given > 1 else ''}: each rank needs one; give more GPUs or set trainer.ranks "
                          f"to {given} (0: one per GPU)")
    if ranks:
        return ranks
    return given or 1


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_ranks(argv: list[str], world: int) -> int:
    """Run `python -m pipeline *argv` as `world` ranks on this host under torchrun's agent; returns the exit
    code: 0, the first failed rank's, or 130 after a signal."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # the agent's own files (the ranks' error files) in a folder that goes with it: by default it makes a
    # torchelastic_* folder in the temp folder at each start and leaves it there
    with tempfile.TemporaryDirectory(prefix="pipeline-ranks-") as files:
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=str(uuid.uuid4()),
                              rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.5,
                              logs_specs=DefaultLogsSpecs(log_dir=files))
        try:
            elastic_launch(config, sys.executable)("-m", "pipeline", *argv)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            log.error("learner rank %d failed with exit code %d; the other ranks were stopped", rank,
                      failure.exitcode)
            return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        except SignalException:  # the ranks were stopped with the signal, as on Ctrl-C
            return 130
    return 0


def end_with_parent() -> None:
    """This process gets SIGTERM (it ends as on Ctrl-C, removing its files) once the thread that started it is
    gone: a rank does not outlive its launcher. Linux only (PR_SET_PDEATHSIG); elsewhere a no-op."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the parent died before the line above: this process was handed to init
        os.kill(os.getpid(), signal.SIGTERM)
