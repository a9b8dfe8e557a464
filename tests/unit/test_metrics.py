"""Each step's record goes to metrics.jsonl and, as scalars, to TensorBoard."""

import json

from pipeline.metrics import MetricsWriter, read_jsonl, read_metrics


def test_a_record_reaches_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, tensorboard=True)
    for step in range(3):
        writer.write({"step": step, "reward/mean": 0.1 * step, "staleness/max_lag": 1, "time/wait_s": 0.0,
                      "time/step_s": 1.0, "sync/weights_ms": 2.0, "throughput/tokens_per_s": 3.0,
                      "mismatch/kl_lag0": 1e-4, "skipped": False, "trained": [[0, 1, 0, "g"]]})
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "reward/mean" in scalars and "mismatch/kl_lag0" in scalars and "trained" not in scalars
    assert [round(e.value, 3) for e in events.Scalars("reward/mean")] == [0.0, 0.1, 0.2]


def test_a_record_still_being_written_is_left_out_until_its_line_is_whole(tmp_path):
    # a reader beside the writer (the tests, the launcher, `pipeline status`) can read a line the writer has begun:
    # CI read half a step record and failed on its JSON
    path = tmp_path / "metrics.jsonl"
    whole = json.dumps({"step": 0, "trained": [[0, 1, 0, "gen-a"]]}) + "\n"
    begun = json.dumps({"step": 1, "trained": [[0, 2, 1, "gen-a"]]})
    path.write_text(whole + begun[:20])
    assert read_jsonl(path) == [{"step": 0, "trained": [[0, 1, 0, "gen-a"]]}]
    path.write_text(whole + begun + "\n")
    assert [r["step"] for r in read_jsonl(path)] == [0, 1]
