"""The BM2 report functions, including null handling, and one short run."""
import json
import re

import pytest

from bench import issuance


def test_percentiles_nearest_rank():
    samples = [1000 * i for i in range(1, 101)]  # 1..100 us
    p = issuance.percentiles_us(samples)
    assert p == {"p50_us": 50.0, "p90_us": 90.0, "p99_us": 99.0, "samples": 100}


def test_percentiles_of_nothing_is_null():
    assert issuance.percentiles_us(None) is None
    assert issuance.percentiles_us([]) is None
    with pytest.raises(ValueError):
        issuance.percentiles_us([float("nan")])


def test_decision_at_the_window():
    d = issuance.bm2_decision(per_expert_p50_us=1132.1, batched_p50_us=101.5, window_us=1000)
    assert d["per_expert_exposed"] is True
    assert d["batched_justified"] is True
    assert d["crossover_window_us"] == {"low_us": 101.5, "high_us": 1132.1}
    d = issuance.bm2_decision(per_expert_p50_us=400.0, batched_p50_us=3.0, window_us=1000)
    assert d["per_expert_exposed"] is False and d["batched_justified"] is False
    d = issuance.bm2_decision(per_expert_p50_us=400.0, batched_p50_us=3.0, window_us=100)
    assert d["per_expert_exposed"] is True and d["batched_justified"] is True
    d = issuance.bm2_decision(per_expert_p50_us=400.0, batched_p50_us=3.0, window_us=2)
    assert d["per_expert_exposed"] is True and d["batched_justified"] is False


def test_decision_with_unmeasured_modes_is_null():
    d = issuance.bm2_decision(None, 3.0, 1000)
    assert d["per_expert_exposed"] is None and d["batched_justified"] is None
    assert d["crossover_window_us"] is None
    d = issuance.bm2_decision(400.0, None, 1000)
    assert d["per_expert_exposed"] is False and d["batched_justified"] is None
    with pytest.raises(ValueError):
        issuance.bm2_decision(1.0, 1.0, 0)


def test_report_keeps_unmeasured_modes_null():
    report = issuance.build_bm2_report(
        {"python-per-expert": [2000] * 5, "batched-cython": [1000] * 5, "cpp-internal": None},
        machine={"node": "x"},
        backend="host",
        block_size=768,
        warmup=1,
        iterations=5,
    )
    assert report["modes"]["cpp-internal"] is None
    assert report["modes"]["batched-cython"]["p50_us"] == 1.0
    assert report["per_expert_over_batched_p50"] == 2.0
    json.dumps(report)  # serialisable, null stays null
    assert "null" in issuance.format_table(report)


def test_short_run_writes_json(tmp_path, capsys):
    out = tmp_path / "bm2.json"
    rc = issuance.main(["--experts", "4", "--layers", "3", "--warmup", "2", "--iterations", "10", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["block_size"] == 12 and report["backend"] == "host"
    for mode in issuance.MODES:
        row = report["modes"][mode]
        assert row["samples"] == 10 and row["p50_us"] > 0
        assert row["p50_us"] <= row["p90_us"] <= row["p99_us"]
    assert "batched-cython" in capsys.readouterr().out


def test_window_from_json(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"window_us": 250}))
    assert issuance.read_window(str(path)) == 250.0
    path.write_text(json.dumps({"window_us": -1}))
    with pytest.raises(SystemExit):
        issuance.read_window(str(path))


def test_unavailable_backend_reports_null(tmp_path):
    out = tmp_path / "bm2.json"
    rc = issuance.main(["--backend", "cuda", "--iterations", "3", "--warmup", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    if report["backend"] is None:  # no CUDA here: every mode null, non-zero exit
        assert rc == 1
        assert all(report["modes"][m] is None for m in issuance.MODES)
    else:
        assert rc == 0 and report["backend"] == "cuda"


def test_help_names_only_options_that_exist(capsys):
    with pytest.raises(SystemExit) as exit_info:
        issuance.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    named = set(re.findall(r"\[(--[a-z][a-z-]*)", issuance.__doc__))
    assert named >= {"--experts", "--layers", "--window-us", "--json"}
    for option in named:
        assert re.search(rf"^\s+{option}\b", text, re.M), f"the usage names {option}, which the parser lacks"
    assert "window W" in text and "null" in text  # the output's last line and null rows are explained


def test_table_explains_null_rows_and_the_window_line():
    report = issuance.build_bm2_report(
        {"python-per-expert": [400_000] * 3, "batched-cython": [4_000] * 3, "cpp-internal": [3_500] * 3},
        machine={}, backend="host", block_size=768, warmup=0, iterations=3, window_us=100,
    )
    table = issuance.format_table(report)
    assert "torch-by-hand             null" in table
    assert "null: not measured on this machine" in table
    assert "crossover=[4.00, 400.00) us" in table
    assert "exposed: per-expert p50 >= W" in table


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    ('{"window_us": "wide"}', "expected a positive 'window_us'"),
])
def test_a_bad_window_json_is_refused_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "w.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        issuance.main(["--window-json", str(path), "--iterations", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"--window-json {path}: {message}" in err and "Traceback" not in err
