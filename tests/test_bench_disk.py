"""bench/disk.py --smoke-cpu: the disk bench runs end to end on tiny files
(raw preadv on one thread and on many, DiskReader at each thread count,
the byte check), and reports
the GPU row as null with its reason where there is no CUDA; bad arguments
(a repeated thread count, a missing --dir) are refused by the parser."""
import json

import pytest

from bench import disk


def test_disk_bench_smoke(tmp_path, capsys):
    out = tmp_path / "disk.json"
    assert disk.main(["--smoke-cpu", "--dir", str(tmp_path), "--json", str(out)]) == 0
    assert "smoke ok" in capsys.readouterr().out
    report = json.loads(out.read_text())
    result = report["result"]
    assert report["config"]["smoke_cpu"] and result["byte_exact"]
    assert [row["threads"] for row in result["reader"]] == report["config"]["threads"]
    for row in result["reader"]:
        assert row["gbps"] > 0 and row["over_raw"] > 0 and len(row["samples_gbps"]) == report["config"]["reps"]
        assert row["over_raw_parallel"] > 0
    # the parallel raw baseline: as many preadv threads as the largest reader keeps reads in flight
    assert result["raw_parallel_threads"] == 2 * max(report["config"]["threads"])
    assert result["raw_parallel_gbps"] > 0 and len(result["raw_parallel_samples_gbps"]) == report["config"]["reps"]
    assert isinstance(result["direct"], bool) and result["page_cache"]
    engine = result["engine"]  # the engine's disk tier, host budget below the files
    assert engine["gbps"] > 0 and engine["over_raw"] > 0 and len(engine["samples_gbps"]) == report["config"]["reps"]
    gpu = result["gpu"]
    if disk.gpu_reason() is None:
        assert gpu["gbps"] > 0 and gpu["reason"] is None
    else:
        assert gpu["gbps"] is None and gpu["over_raw"] is None and gpu["reason"] == disk.gpu_reason()
    assert list(tmp_path.iterdir()) == [out]  # the bench's files are gone


@pytest.mark.parametrize("args, message", [
    (["--threads", "1", "1", "--reps", "2"], "--threads counts must differ, got 1 1"),
    (["--threads", "2", "1", "2"], "--threads counts must differ"),
    (["--range-mib", "nan"], "--range-mib must be finite"),
])
def test_bad_arguments_are_refused_by_the_parser(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        disk.parse(["--dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_missing_dir_is_refused_by_the_parser(tmp_path, capsys):
    missing = tmp_path / "nonexist"
    with pytest.raises(SystemExit) as exit_info:
        disk.main(["--smoke-cpu", "--dir", str(missing)])
    assert exit_info.value.code == 2
    assert f"--dir {missing}: no such directory" in capsys.readouterr().err


def test_smoke_help_tells_its_real_round_count(capsys):
    args = disk.parse(["--smoke-cpu"])
    with pytest.raises(SystemExit):
        disk.parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert f"--smoke-cpu tiny files, {args.reps} rounds" in text and "one round," not in text
