"""The benchmarks' pictures: the context curves drawn from the CSV the benchmark writes."""

from __future__ import annotations

from pathlib import Path

from benchmarks.plots import main, read_rows

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_context_curves_are_drawn_from_the_csv(tmp_path: Path) -> None:
    csv = tmp_path / "context.csv"
    csv.write_text(
        "step,off_large_prompt,off_large_total,truncate_small_prompt,truncate_small_total\n"
        "1,100,100,100,100\n"
        "2,200,300,150,250\n"
        "3,300,600,,\n"  # a run that ended early leaves its cells empty
    )
    rows = read_rows(csv)
    assert rows[2] == {
        "step": 3,
        "off_large_prompt": 300,
        "off_large_total": 600,
        "truncate_small_prompt": None,
        "truncate_small_total": None,
    }
    png = tmp_path / "context.png"
    assert main(["context", str(csv), str(png)]) == 0
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_a_wrong_call_says_how_to_call_it() -> None:
    assert main(["nonsense"]) == 2
