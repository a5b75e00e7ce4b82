"""Writes report.md and the PNG plots next to report.json."""
from __future__ import annotations

from pathlib import Path

from loadgen.report_md import render_markdown


def render_outputs(report: dict, out_dir: Path, with_plots: bool = True) -> list[Path]:
    out_dir = Path(out_dir)
    plot_files: list[str] = []
    if with_plots:
        from loadgen.plots import render_plots  # matplotlib only when plots are wanted

        plot_files = render_plots(report, out_dir)
    md = out_dir / "report.md"
    md.write_text(render_markdown(report, plot_files), encoding="utf-8")
    return [md] + [out_dir / f for f in plot_files]
