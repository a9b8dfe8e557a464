"""Rank 0's messages to the other learner ranks (learner/service.py `next_batch`: each batch, "still waiting" every
KEEPALIVE_S, the end of the run) go over the ranks' gloo group on the CPU (learner/model.py `control_group`, made by
`Place.join`), never over the group the ranks train with. Over nccl, a rank waiting for its batch waited in a kernel
spinning on its GPU for as long as rank 0 waited for rollouts, beside the engine on that GPU
(configs/colocated-2gpu.yaml).

Two real ranks in processes of their own. On CPU the ranks train over gloo too, so the test checks which group each
broadcast went over and where its tensors were, and that the batch arrived whole."""

from __future__ import annotations

import json
import multiprocessing
import os

from pipeline.netutil import reserved_port


class FakeHub:
    """Rank 0's hub: no batch at the first two looks (the others hear "still waiting"), then `batch`; then the dataset
    is exhausted."""

    def __init__(self, batch):
        self.answers = [None, None, batch]

    def take_batch(self, step, wait_s=None):
        from hub.hub import DatasetExhausted

        if not self.answers:
            raise DatasetExhausted("the dataset is exhausted (test)")
        return self.answers.pop(0), {}, {"trainer.lr": 1e-6}

    def step_stats(self):
        from hub.trainer import HubStats

        return HubStats(tokens=0, generators=1, counters={}, busy={}, stages={})


def batch():
    from pipeline import protocol as P

    return [P.RolloutGroup(1, "g", pid, 0, P.pack_ints([4, 5, pid]),
                           [P.Sample(P.pack_ints([7, 8, 9]), P.pack_floats([-0.5] * 3), 1.0, [1.0], "stop", 0, 0)])
            for pid in range(3)]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    from pathlib import Path

    import torch.distributed as dist

    from learner import service
    from pipeline import protocol as P
    from pipeline.config import Config

    cfg = Config()
    cfg.trainer.early_proximal = False  # no engine here: only the batch's messages
    place = service.Place.join(cfg, Path(out), profile=False)
    sent: list[list] = []
    broadcast = dist.broadcast

    def recorded(tensor, src, group=None, **kw):
        sent.append([group is place.control, tensor.device.type])  # a gloo group, never None here
        return broadcast(tensor, src, group=group, **kw)

    dist.broadcast = recorded
    hub = FakeHub(batch()) if rank == 0 else None
    groups, _, knobs, end = service.next_batch(hub, 0, cfg, rank, 2, place.control)
    # the run's own loop, to its end: `Learner.step` sends what `Place.join` made
    learner = service.Learner(cfg, None, None, hub=hub, publisher=None, metrics=None, run_dir=Path(out), rank=rank,
                              world=2, control=place.control)
    ended = learner.step(1)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "backend": dist.get_backend(place.control), "sent": sent, "knobs": knobs, "end": end, "ended": ended,
        "groups": [P.encode(g).hex() for g in groups or []]}))
    place.close()
    dist.destroy_process_group()


def test_rank_0s_messages_go_over_the_ranks_cpu_group_not_the_training_group(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    port = reserved_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(180)
        assert [p.exitcode for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    from pipeline import protocol as P

    want = [P.encode(g).hex() for g in batch()]
    for r in got:
        assert r["backend"] == "gloo"
        assert r["groups"] == want and r["knobs"] == {"trainer.lr": 1e-6} and r["end"] == ""
        assert r["ended"] is None  # the step heard that the run ends, on both ranks
        # two looks that found nothing, the batch, then the end: two broadcasts each (size, bytes)
        assert len(r["sent"]) == 8
        assert r["sent"] == [[True, "cpu"]] * 8, r["sent"]

