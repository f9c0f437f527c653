"""bench/diagnostics/ab_pairs.py on BM5 result files written here: two trees compared
round by round through each one's own floor, as stop 43's A/B was."""
from __future__ import annotations

import json

import pytest

from bench.diagnostics import ab_pairs


def _write(folder, trace, tree, rnd, p50, resident, io_floor=28.0, x_floor_runs=None, policy="oracle"):
    row = {"policy": policy, "p50_runs_ms": [p50], "resident_runs_ms": [resident], "io_floor_ms": io_floor}
    if x_floor_runs is not None:
        row["x_floor_runs"] = x_floor_runs
    rows = [{"policy": "all-resident", "p50_runs_ms": [resident], "resident_runs_ms": [resident],
             "io_floor_ms": io_floor}, row]
    folder.mkdir(exist_ok=True)
    (folder / f"ab_{trace}_{tree}_{rnd}.json").write_text(json.dumps({"rows": rows}))


def test_each_round_goes_to_the_tree_with_the_lower_ratio_to_its_own_floor(tmp_path, capsys):
    ab = ab_pairs
    run = tmp_path / "run1"
    # Round 1: "new" has the higher p50 (40 against 35) but ran beside a slow
    # resident step (38 ms, over the 28 ms IO floor): 40/38 = 1.05 against
    # 35/28 = 1.25, so it wins the round.
    _write(run, "gpt-oss-120b", "new", 1, 40.0, 38.0)
    _write(run, "gpt-oss-120b", "old", 1, 35.0, 22.0)
    # Round 2: the ratio BM5 wrote (x_floor_runs) is taken as it is.
    _write(run, "gpt-oss-120b", "new", 2, 30.0, 20.0, x_floor_runs=[1.30])
    _write(run, "gpt-oss-120b", "old", 2, 30.0, 20.0, x_floor_runs=[1.10])
    report = ab.summarize(ab.load([str(run)], "oracle"))["gpt-oss-120b"]
    assert report["trees"] == ["new", "old"]
    assert [r["lower"] for r in report["rounds"]] == ["new", "old"]
    assert report["rounds"][0]["new"] == (40.0, 38.0, pytest.approx(40 / 38))
    assert report["rounds_won"] == {"new": 1, "old": 1}
    assert report["median_ratio"]["new"] == pytest.approx((40 / 38 + 1.30) / 2)
    assert report["median_ratio"]["old"] == pytest.approx((35 / 28 + 1.10) / 2)
    assert ab.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "rounds won: new 1, old 1 of 2" in out


def test_aliases_pool_runs_that_named_the_trees_differently(tmp_path):
    ab = ab_pairs
    older, newer = tmp_path / "run140", tmp_path / "run143"
    _write(older, "gemma4-26b-a4b", "5f62246", 1, 30.0, 25.0)
    _write(older, "gemma4-26b-a4b", "0bf545f", 1, 33.0, 25.0)
    _write(newer, "gemma4-26b-a4b", "new", 1, 30.0, 30.0)
    _write(newer, "gemma4-26b-a4b", "old", 1, 29.0, 30.0)
    with pytest.raises(ValueError, match="two trees"):
        ab.summarize(ab.load([str(older), str(newer)], "oracle"))
    pairs = ab.load([str(older), str(newer)], "oracle", {"new": "5f62246", "old": "0bf545f"})
    report = ab.summarize(pairs)["gemma4-26b-a4b"]
    assert [r["lower"] for r in report["rounds"]] == ["5f62246", "0bf545f"]
    assert report["rounds_won"] == {"5f62246": 1, "0bf545f": 1}


def test_bad_files_are_refused_by_name(tmp_path, capsys):
    ab = ab_pairs
    run = tmp_path / "run"
    _write(run, "t", "new", 1, 30.0, 20.0, policy="on-demand")
    _write(run, "t", "old", 1, 30.0, 20.0)
    with pytest.raises(ValueError, match=r"ab_t_new_1\.json: no measured row of policy 'oracle'"):
        ab.load([str(run)], "oracle")
    (run / "ab_t_new_1.json").write_text("{not json")
    assert ab.main([str(run)]) == 2
    assert "ab_t_new_1.json: not a BM5 result" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ab.main([str(empty)]) == 2
    assert "no ab_<trace>_<tree>_<round>.json files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(run), "--alias", "new"])


def _write_e2e(folder, trace, rows):
    folder.mkdir(exist_ok=True)
    (folder / f"e2e_{trace}.json").write_text(json.dumps({"rows": rows}))


def test_two_rows_of_one_run_are_paired_round_by_round(tmp_path, capsys):
    # --rows: two policies of the same BM5 run (--repeats 3), each round's
    # pair beside that round's resident run. Round 2's resident run was
    # slow (40 ms, over the 28 ms IO floor): both rows are judged against it.
    ab = ab_pairs
    run = tmp_path / "run149"
    resident = [25.0, 40.0, 26.0]
    a = {"policy": "oracle", "p50_runs_ms": [30.0, 44.0, 36.0], "resident_runs_ms": resident, "io_floor_ms": 28.0}
    b = {"policy": "oracle:cap=8", "p50_runs_ms": [33.0, 42.0, 37.0], "resident_runs_ms": resident,
         "io_floor_ms": 28.0, "x_floor_runs": [33 / 28, 42 / 40, 37 / 28]}
    _write_e2e(run, "gpt-oss-120b", [{"policy": "all-resident", "p50_runs_ms": resident}, a, b])
    report = ab.summarize(ab.load_rows([str(run)], ("oracle", "oracle:cap=8")))["gpt-oss-120b"]
    assert report["trees"] == ["oracle", "oracle:cap=8"]
    assert [r["lower"] for r in report["rounds"]] == ["oracle", "oracle:cap=8", "oracle"]
    assert report["rounds"][1]["oracle"] == (44.0, 40.0, pytest.approx(44 / 40))
    assert report["rounds_won"] == {"oracle": 2, "oracle:cap=8": 1}
    assert report["median_ratio"]["oracle"] == pytest.approx(44 / 40)  # of 30/28, 44/40, 36/28
    assert ab.main([str(run), "--rows", "oracle", "oracle:cap=8"]) == 0
    assert "rounds won: oracle 2, oracle:cap=8 1 of 3" in capsys.readouterr().out


def test_rows_that_are_not_both_measured_are_refused(tmp_path, capsys):
    ab = ab_pairs
    run = tmp_path / "run"
    _write_e2e(run, "gemma4-26b-a4b", [{"policy": "oracle", "p50_runs_ms": [30.0], "resident_runs_ms": [25.0],
                                       "io_floor_ms": 9.0}])
    assert ab.main([str(run), "--rows", "oracle", "on-demand"]) == 2
    assert "no measured row of policy 'on-demand'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main([str(run), "--rows", "oracle", "oracle"])
