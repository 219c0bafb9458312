"""bench/ab_summary.py, whose tables bench/RESULTS.md quotes: each label's ratio to the first one's, and the
rounds in which the first label's p99 was at most each other label's, over lines as bench/ab.sh writes them."""
from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SUMMARY = Path(__file__).resolve().parent.parent / "bench" / "ab_summary.py"
LINE = "{:<10} round {}  {:<12} c={:<4} {}  batch/queue_us {}  core0 99% core1 50%  load 1.00\n"


def summary(tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str]) -> list[list[str]]:
    ab = tmp_path / "ab.txt"
    ab.write_text("idle: despina uses 1.0% of a core with every server idle (10 s)\n" + "".join(lines))
    runpy.run_path(str(SUMMARY), run_name="not_main")["main"](str(ab))
    rows = capsys.readouterr().out.splitlines()
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows if not row.startswith("|---")]


def test_ratios_and_p99_counts_pair_rounds_and_skip_a_failed_point(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        LINE.format("despina", 1, "mlp", 8, "failed - -", "- -"),       # this round pairs with nothing
        LINE.format("triton", 1, "mlp", 8, "4000 1.50 9.00", "6.0 500"),
        LINE.format("triton", 2, "mlp", 8, "3000 1.60 5.00", "6.0 500"),
        LINE.format("despina", 2, "mlp", 8, "4000 1.50 4.00", "7.9 600"),
        LINE.format("despina", 3, "mlp", 8, "4000 1.50 3.50", "7.8 600"),
        LINE.format("triton", 3, "mlp", 8, "5000 1.40 3.00", "6.1 500"),
    ]
    header, row = summary(tmp_path, capsys, lines)
    assert header == ["model", "conc", "despina", "triton", "triton / despina",
                      "despina's p99 at most triton's"]
    # rates: triton's 12,000 over despina's 8,000 would be wrong: a failed round leaves the lists unequal
    assert row[:4] == ["mlp", "8", "4,000, 4,000", "4,000, 3,000, 5,000"]
    assert row[4] == "-"
    assert row[5] == "1 of 2"  # round 1 failed; 4.00 <= 5.00 in round 2; 3.50 > 3.00 in round 3


def test_a_limit_label_has_no_p99_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        LINE.format("limit", 1, "conv_heavy", 64, "2800 45.00 46.00", "128.0 limit"),
        LINE.format("despina", 1, "conv_heavy", 64, "2100 30.00 40.00", "60.1 9000"),
        LINE.format("despina", 2, "conv_heavy", 64, "2200 30.00 40.00", "60.3 9000"),
        LINE.format("limit", 2, "conv_heavy", 64, "2600 45.00 46.00", "128.0 limit"),
    ]
    header, row = summary(tmp_path, capsys, lines)
    assert header == ["model", "conc", "limit", "despina", "despina / limit"]
    assert row == ["conv_heavy", "64", "2,800, 2,600", "2,100, 2,200", "0.80 (0.75–0.85)"]
