"""bench/diagnostics/ab_pool.py on BM6 result files written here: --ab pairs of several
runs pooled, per model, batch, share and rows."""
from __future__ import annotations

import json
import re
import statistics

import pytest

from bench.diagnostics import ab_pool


def _ab(pairs, rows=("gate", "on-demand"), model="olmoe-1b-7b", share=0.25, **parts):
    return {"model": model, "batch": 1, "share": share, "rows": list(rows), "pairs_ms": pairs,
            "lockstep": parts.pop("lockstep", None), **parts}


def _write(path, *abs_, paired_tokens=16):
    blocks = [{"model": ab["model"], "ab": ab} for ab in abs_] + [{"model": "no-ab"}]
    path.write_text(json.dumps({"config": {"paired_tokens": paired_tokens}, "blocks": blocks}))
    return str(path)


def test_pairs_pool_per_cell_with_the_figures_bm6_gives_one_run(tmp_path, capsys):
    tool = ab_pool
    one = [[10.0, 10.0], [9.0, 10.0], [12.0, 10.0], [10.0, 11.0], [10.0, 9.0], [20.0, 10.0]]
    two = [[10.0, 10.5], [11.0, 10.0], [9.5, 10.0], [10.0, 10.0], [10.2, 10.0], [10.0, 12.0], [8.0, 10.0]]
    other = [[5.0, 4.0], [5.0, 4.5]]
    f1 = _write(tmp_path / "a.json", _ab(one), _ab(other, model="qwen3-30b-a3b"), paired_tokens=32)
    f2 = _write(tmp_path / "b.json", _ab(two))
    report = tool.pool([f1, f2])
    assert [(g["model"], g["rows"]) for g in report] == [("olmoe-1b-7b", ["gate", "on-demand"]),
                                                         ("qwen3-30b-a3b", ["gate", "on-demand"])]
    olmoe = report[0]
    assert [(r["file"], r["pairs"], r["paired_tokens"]) for r in olmoe["runs"]] == [(f1, 6, 32), (f2, 7, 16)]
    every = one + two
    ratios = [a / b for a, b in every]
    assert olmoe["pooled"]["pairs"] == 13
    assert olmoe["pooled"]["x_ab"] == pytest.approx(statistics.median(ratios))
    assert olmoe["pooled"]["a_faster"] == sum(a < b for a, b in every)
    low, high, cover = olmoe["pooled"]["x_ab_ci"]
    assert low <= statistics.median(ratios) <= high and 0.95 <= cover < 1
    assert olmoe["runs"][0]["x_ab"] == pytest.approx(statistics.median(a / b for a, b in one))
    assert report[1]["pooled"]["pairs"] == 2 and report[1]["pooled"]["x_ab_ci"] is None
    assert tool.main([f1, f2, "--json", str(tmp_path / "out.json")]) == 0
    out = capsys.readouterr().out
    assert "pooled: 13 pairs" in out and "(paired tokens 32)" in out
    assert json.loads((tmp_path / "out.json").read_text())[0]["pooled"]["pairs"] == 13


def test_parts_and_lockstep_pick_their_pairs_and_swapped_ones_turn_round(tmp_path):
    tool = ab_pool
    ab = _ab([[10.0, 11.0]], lockstep={"pairs_ms": [[7.0, 8.0], [8.0, 7.5]]},
             control={"rows": ["on-demand", "on-demand"], "pairs_ms": [[10.0, 10.1]], "lockstep": None},
             swapped={"rows": ["on-demand", "gate"], "pairs_ms": [[11.0, 10.0], [12.0, 9.0]], "lockstep": None},
             pooled={"pairs_ms": [[10.0, 11.0], [10.0, 11.0], [9.0, 12.0]], "lockstep": None})
    f = _write(tmp_path / "a.json", ab)
    assert tool.load(f)[0]["pairs"] == [[10.0, 11.0]]
    assert tool.load(f, lockstep=True)[0]["pairs"] == [[7.0, 8.0], [8.0, 7.5]]
    control = tool.load(f, "control")[0]
    assert control["pairs"] == [[10.0, 10.1]] and control["key"][3] == ("on-demand", "on-demand")
    swapped = tool.load(f, "swapped")[0]
    assert swapped["pairs"] == [[10.0, 11.0], [9.0, 12.0]] and swapped["key"][3] == ("gate", "on-demand")
    assert len(tool.load(f, "pooled")[0]["pairs"]) == 3
    with pytest.raises(ValueError, match="no lockstep pairs"):
        tool.load(f, "control", lockstep=True)
    with pytest.raises(ValueError, match="--part must be one of"):
        tool.load(f, "both")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a BM6 result"),
    ("[]", "not a BM6 result"),
    ('{"blocks": 3}', "not a BM6 result"),
    ('{"blocks": []}', "no block with an --ab"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": []}}]}', "no pairs"),
    ('{"blocks": [{"ab": {"model": ["x"], "batch": 1, "share": 0.25, "rows": ["gate", "on-demand"], '
     '"pairs_ms": [[1.0, 2.0]]}}]}', "no model, batch and share"),
    ('{"blocks": [{"ab": {"model": "x", "batch": true, "share": 0.25, "rows": ["gate", "on-demand"], '
     '"pairs_ms": [[1.0, 2.0]]}}]}', "no model, batch and share"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[1.0, -2.0]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[true, 2.0]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[1.0, 2.0, 3.0]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[1.0, "2"]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[Infinity, 2.0]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[NaN, 2.0]]}}]}', "two positive, finite ms"),
    ('{"blocks": [{"ab": {"rows": "gate", "pairs_ms": [[1.0, 2.0]]}}]}', "no rows"),
    ('{"blocks": [{"ab": {"rows": ["gate", "on-demand"], "pairs_ms": [[1.0, 2.0]], "swapped": null}}]}',
     "not in this file"),
    ('{"config": 3, "blocks": []}', "not a BM6 result"),
])
def test_a_malformed_result_gets_a_clear_error_naming_it(tmp_path, capsys, content, message):
    tool = ab_pool
    path = tmp_path / "bad.json"
    path.write_text(content)
    part = "swapped" if '"swapped"' in content else "ab"
    with pytest.raises(ValueError, match=message) as err:
        tool.load(str(path), part)
    assert str(path) in str(err.value)
    with pytest.raises(SystemExit):  # the command line says so too, without a traceback
        tool.main([str(path), "--part", part])
    assert message.split()[0] in capsys.readouterr().err


def test_all_ties_print_no_sign_test_p(tmp_path, capsys):
    tool = ab_pool
    f = _write(tmp_path / "a.json", _ab([[10.0, 10.0], [9.0, 9.0]]))
    assert tool.pool([f])[0]["pooled"]["sign_p"] is None
    assert tool.main([f]) == 0
    out = capsys.readouterr().out
    assert "pooled: 2 pairs" in out and "sign test p n/a" in out


@pytest.mark.parametrize("part, flag", [("swapped", "--ab-swap?"), ("pooled", "--ab-swap?"),
                                        ("control", "--ab-control?")])
def test_a_missing_part_names_the_flag_that_writes_it(tmp_path, part, flag):
    tool = ab_pool
    f = _write(tmp_path / "a.json", _ab([[10.0, 11.0]]))
    with pytest.raises(ValueError, match="not in this file") as err:
        tool.load(f, part)
    assert f"run without {flag})" in str(err.value)


def test_the_part_flags_exist_in_generate(capsys):
    tool = ab_pool
    from bench import generate

    with pytest.raises(SystemExit):
        generate.main(["--help"])
    options = set(re.findall(r"^\s+(--[a-z][a-z-]*)", capsys.readouterr().out, re.M))
    assert set(tool.PART_FLAGS) == set(tool.PARTS) - {"ab"}
    assert set(tool.PART_FLAGS.values()) <= options
