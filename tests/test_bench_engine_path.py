"""bench/engine_path.py runs on the host backend and reports every row,
the step plan's call among them; no timing assertions. Bad arguments are
refused by the parser; an unavailable backend gives null rows, exit 1."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import engine_path  # noqa: E402

ROWS = {"step", "by-hand-separate", "by-hand-layer", "exchange", "separate-calls", "pin-layer", "step-plan",
        "hints-one-time", "hints-clear"}


def test_engine_path_reports_every_row_on_the_host_backend(tmp_path):
    out = tmp_path / "engine_path.json"
    assert engine_path.main(["--backend", "host", "--layers", "4", "--experts", "16", "--top", "2",
                             "--iterations", "40", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["backend"] == "host"
    assert set(got["rows"]) == ROWS
    for row in got["rows"].values():
        assert row["p50_us"] > 0 and row["p90_us"] >= row["p50_us"] and row["iterations"] > 0
    assert got["rows"]["step-plan"]["per"] == "step"
    assert got["rows"]["hints-one-time"]["per"] == got["rows"]["hints-clear"]["per"] == "call"
    # The first handle's acquires hit but for its warm-up's; every expert of
    # the second is resident, so each of the step plan's pins finds its own.
    assert 0.5 < got["hit_rate"] < 1 and got["step_plan_pins_resident"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["--top", "20", "--experts", "16"], "--top 20 is more than --experts 16"),
    (["--iterations", "0"], "must be positive"),
    (["--layers", "0"], "must be positive"),
    (["--experts", "0"], "must be positive"),
    (["--top", "0"], "must be positive"),
    (["--thrash-mb", "-1"], "--thrash-mb must be >= 0"),
])
def test_bad_arguments_are_refused_by_the_parser(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        engine_path.main(["--backend", "host", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unavailable_backend_reports_null_rows_and_exit_1(tmp_path, capsys, monkeypatch):
    import prefetch

    def unavailable(*args, **kwargs):
        raise prefetch.BackendUnavailableError("no CUDA driver here")

    monkeypatch.setattr(engine_path, "resident_handle", unavailable)
    out = tmp_path / "engine_path.json"
    assert engine_path.main(["--backend", "cuda", "--layers", "2", "--experts", "4", "--top", "2",
                             "--iterations", "5", "--json", str(out)]) == 1
    got = json.loads(out.read_text())
    assert got["backend"] is None and got["requested_backend"] == "cuda"
    assert set(engine_path.ROWS) == set(got["rows"]) == ROWS and all(row is None for row in got["rows"].values())
    assert got["hit_rate"] is None and got["step_plan_pins_resident"] is None
    captured = capsys.readouterr()
    assert "not measured" in captured.out and "null" in captured.out
    assert "no CUDA driver here" in captured.err


def test_backend_cuda_measures_or_reports_null(tmp_path):
    out = tmp_path / "engine_path.json"
    rc = engine_path.main(["--backend", "cuda", "--layers", "2", "--experts", "4", "--top", "2",
                           "--iterations", "5", "--json", str(out)])
    got = json.loads(out.read_text())
    if got["backend"] is None:  # no CUDA here: every row null, non-zero exit
        assert rc == 1 and all(row is None for row in got["rows"].values())
    else:
        assert rc == 0 and got["backend"] == "cuda" and set(got["rows"]) == ROWS
