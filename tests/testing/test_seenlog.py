"""The seen-log's exactly-once check: later runs supersede what earlier runs did from their resume step on."""

import os

from padfree.testing import seenlog


def rec(run, step, index, epoch=0, rank=0):
    return {"run": run, "epoch": epoch, "step": step, "rank": rank, "index": index}


def test_later_runs_supersede_from_their_resume_step():
    # run a: steps 0-3 (samples 0..3), killed; run b resumed at 2 with a different split of the rest
    records = [rec("a", 0, 0), rec("a", 1, 1), rec("a", 2, 2), rec("a", 3, 3),
               rec("b", 2, 3), rec("b", 2, 2)]  # fmt: skip
    kept = seenlog.counted(records)
    assert [(r["run"], r["index"]) for r in kept] == [("a", 0), ("a", 1), ("b", 3), ("b", 2)]
    assert seenlog.check_exactly_once(records, 4, 1)["ok"]


def test_lost_duplicated_and_cut_lines_are_reported(tmp_path):
    path = tmp_path / "seen.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    seenlog.append(fd, "a", 0, 0, 0, [0, 1])
    seenlog.append(fd, "a", 0, 1, 1, [1])
    os.write(fd, b'{"run": "a", "epoch": 0, "st')  # a line cut by SIGKILL
    seenlog.append(fd, "b", 0, 2, 0, [4])  # the next run's first line survives
    os.close(fd)
    records = seenlog.read(path)
    assert len(records) == 4 and records[-1]["run"] == "b"
    report = seenlog.check_exactly_once(records, 3, 1)
    assert not report["ok"]
    assert report["epochs"][0] == {
        "epoch": 0,
        "missing": 1,
        "duplicated": 1,
        "foreign": 1,
        "dropped_trained": 0,
    }


def test_samples_dropped_on_purpose_are_not_lost_and_must_not_train(tmp_path):
    # issue 28: a run under --overlong drop never trains the samples over the budget; the log says which
    path = tmp_path / "seen.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    seenlog.append_dropped(fd, "a", [2])
    seenlog.append(fd, "a", 0, 0, 0, [0, 1])
    seenlog.append(fd, "a", 0, 1, 0, [3])
    seenlog.append_dropped(fd, "b", [2])  # a resumed run says it again
    seenlog.append(fd, "b", 1, 2, 0, [3, 0, 1])
    os.close(fd)
    records = seenlog.read(path)
    assert len(records) == 6 and seenlog.read_dropped(path) == {2}
    report = seenlog.check_exactly_once(records, 4, 2, dropped=seenlog.read_dropped(path))
    assert report["ok"], report
    assert report["dropped"] == 1 and report["epochs"][1] == {
        "epoch": 1,
        "missing": 0,
        "duplicated": 0,
        "foreign": 0,
        "dropped_trained": 0,
    }
    assert not seenlog.check_exactly_once(records, 4, 2)["ok"]  # without the drops sample 2 is missing
    # a dropped sample that trains anyway, or a drop outside the data, is an error
    trained = seenlog.check_exactly_once(records, 4, 2, dropped={1})
    assert not trained["ok"] and trained["epochs"][0]["dropped_trained"] == 1
    assert not seenlog.check_exactly_once(records, 4, 2, dropped={2, 9})["ok"]
