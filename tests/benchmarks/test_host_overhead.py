"""benchmarks/host_overhead.py: its options and the baseline checkout it is pointed at."""

from __future__ import annotations

import pytest

from benchmarks.host_overhead import _best, parse_args


def test_sizes_and_bounds_are_checked(tmp_path):
    assert parse_args(["--sizes", "1, 64,256"]).size_list == [1, 64, 256]
    for bad in (["--sizes", "a,2"], ["--sizes", "0"], ["--steps", "0"], ["--warmup", "-1"],
                ["--baseline-repo", str(tmp_path)]):  # a folder without a kvflow package
        with pytest.raises(SystemExit):
            parse_args(bad)
    (tmp_path / "kvflow").mkdir()
    (tmp_path / "kvflow" / "__init__.py").write_text("")
    assert parse_args(["--baseline-repo", str(tmp_path)]).baseline_repo == str(tmp_path)


def test_best_round_is_kept_per_size():
    rounds = [{"kvflow": "x", "sizes": {"1": {"steps_per_s": 5.0}, "64": {"steps_per_s": 1.0}}},
              {"kvflow": "x", "sizes": {"1": {"steps_per_s": 4.0}, "64": {"steps_per_s": 2.0}}}]
    best = _best(rounds)
    assert best["sizes"]["1"]["steps_per_s"] == 5.0 and best["sizes"]["64"]["steps_per_s"] == 2.0


def test_compare_repos_are_labelled_and_checked(tmp_path):
    (tmp_path / "kvflow").mkdir()
    (tmp_path / "kvflow" / "__init__.py").write_text("")
    args = parse_args(["--compare-repo", f"main={tmp_path}"])
    assert args.compare == {"main": tmp_path.resolve()}
    for bad in ([f"{tmp_path}"], [f"current={tmp_path}"], [f"main={tmp_path / 'nothing'}"],
                [f"main={tmp_path}", f"main={tmp_path}"]):
        with pytest.raises(SystemExit):
            parse_args([a for entry in bad for a in ("--compare-repo", entry)])


def test_the_collector_timer_counts_each_collection_and_its_time():
    import gc
    import time

    from benchmarks.host_overhead import CollectorTimer

    timer = CollectorTimer()
    gc.callbacks.append(timer)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(timer)
    assert timer.counts == {0: 1, 1: 0, 2: 1}
    assert 0 < timer.longest <= timer.seconds
    timer("start", {"generation": 1})
    time.sleep(0.01)
    timer("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    assert timer.counts[1] == 1 and timer.longest >= 0.01
