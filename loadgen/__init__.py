"""Load generator and cache-reuse reports (`reuse-loadgen`). Reaches the server only over HTTP.

    reuse-loadgen run --server http://127.0.0.1:8000 --workload all --compare --out out/
    reuse-loadgen report out/          # re-render report.md and the plots from out/report.json

Layout: `workloads/` builds the traffic (one module per workload, all decided by the seed before
anything is sent); `client.py` sends one request with the openai async client and times it;
`runner.py` runs a phase with bounded concurrency and time; `metrics_scrape.py` reads /metrics;
`report.py`, `report_md.py`, `plots.py` and `render.py` turn results into report.json, report.md
and PNGs; `run.py` and `report_cmd.py` are the subcommands.
"""
