"""Run every benchmark, one subprocess after another, and keep what each prints.

Each benchmark's JSON lines go to benchmarks/results/<name>.jsonl after a header line (date, git commit,
command line, machine: platform, CPU model, cores, memory, torch version, CUDA device) and before a
closing status line (return code, seconds). Everything a benchmark prints is also shown live.
A failing benchmark is recorded and the run goes on; the exit status is 1 if any failed.

    python -m benchmarks.run_all [--quick] [--only ttft,memory] [--out-dir benchmarks/results]

--quick passes smaller sizes to each benchmark (minutes instead of the full run).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from reuse_server.server.openmp import describe, with_short_spin

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"

# name -> extra arguments under --quick (the full run uses each benchmark's defaults)
BENCHMARKS: dict[str, list[str]] = {
    "bench_radix": ["--repeats", "5"],
    "bench_engine": ["--prefill-lens", "256", "--decode-tokens", "8", "--repeats", "1", "--serving-requests", "8"],
    "bench_ttft": ["--lengths", "512,2048", "--warm-repeats", "2", "--servers", "1"],
    "bench_gemma": ["--lengths", "512,2048", "--smollm2-lengths", "512,2048", "--decode-tokens", "32", "--requests", "8"],
    "bench_memory": ["--concurrency", "4", "--prompt-tokens", "512", "--rounds", "1"],
    "bench_burst": ["--requests", "4", "--system-tokens", "512", "--budget", "8192"],
    "bench_rerope": ["--tokens", "1024", "--repeats", "3"],
    "bench_blend": ["--cases", "5", "--ratios", "0,0.15"],
    "bench_structured": ["--repeats", "2", "--http-repeats", "1", "--concurrency", "2"],
    "bench_agents": ["--tasks", "2", "--steps", "3"],
    # the real Codex CLI and Claude Code (`make agents`) on Gemma 3 270M; llama-server where it is on PATH
    "bench_coding_agents": ["--turns", "2", "--replay-sessions", "1"],
    "bench_decode": ["--tokens", "32", "--repeats", "1"],
    "bench_compile": ["--steps", "16", "--rounds", "1", "--weights", "fp32"],
    "bench_weights": ["--cases", "4", "--greedy-prompts", "2", "--greedy-tokens", "16", "--decode-tokens", "32",
                      "--prefill-tokens", "512", "--ttft-tokens", "2048"],
    "bench_kv_dtype": ["--kl-prompts", "4", "--greedy-prompts", "2", "--greedy-tokens", "64", "--needle-cases", "5",
                       "--ttft-tokens", "2048", "--repeats", "2"],
    "bench_tiers": ["--length", "1024", "--skip-working-set"],
    "bench_overload": ["--levels", "8,32", "--seconds", "5", "--burst", "16"],
    "bench_soak": ["--minutes", "1", "--clients", "8"],
    "bench_aiperf": ["--requests", "8"],
    "bench_replicas": ["--replicas", "1,2", "--policies", "round_robin", "--workloads", "multi-turn",
                       "--requests", "12", "--skip-handoff"],
    "bench_failover": ["--replicas", "2", "--conversations", "3", "--turns", "4", "--kill-turn", "2",
                       "--loss-before", "10", "--loss-after", "15"],
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import psutil

        info["memory_bytes"] = psutil.virtual_memory().total
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def json_row(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def child_env() -> dict:
    # how torch's OpenMP threads wait: the server's short spin unless the caller chose otherwise
    return with_short_spin(os.environ)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_one(name: str, args: list[str], out_dir: Path, header: dict, timeout: float | None) -> int:
    """Run benchmarks.<name>; stream its output; write its JSON lines to out_dir/<name>.jsonl."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    path = out_dir / f"{name}.jsonl"
    start = time.monotonic()
    rows = 0
    with open(path, "w") as out:
        out.write(json.dumps({"header": True, "benchmark": name, "command": cmd[1:], **header}) + "\n")
        out.flush()
        # its own process group, so a kill also reaches the server a benchmark started
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
                                env=child_env())
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            kill_group(proc)

        watchdog = threading.Timer(timeout, kill) if timeout else None
        if watchdog:
            watchdog.start()
        try:
            for line in proc.stdout:  # stderr (progress bars, warnings) goes straight to the terminal
                print(line, end="", flush=True)
                row = json_row(line)
                if row is not None:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows += 1
            returncode = proc.wait()
        except KeyboardInterrupt:
            kill_group(proc)
            proc.wait()
            raise
        finally:
            if watchdog:
                watchdog.cancel()
        elapsed = time.monotonic() - start
        timed_out = killed.is_set()
        out.write(json.dumps({"status": True, "benchmark": name, "returncode": returncode, "timed_out": timed_out,
                              "rows": rows, "elapsed_s": round(elapsed, 1)}) + "\n")
    print(f"== {name}: return code {returncode}, {rows} rows, {elapsed:.1f} s -> {path}", flush=True)
    return returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes for every benchmark")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated subset, with or without the bench_ prefix (of: {', '.join(BENCHMARKS)})")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after which one benchmark is killed (default: no limit)")
    args = ap.parse_args(argv)

    names = list(BENCHMARKS)
    if args.only:
        wanted = [n if n.startswith("bench_") else f"bench_{n}" for n in args.only.split(",")]
        unknown = [n for n in wanted if n not in BENCHMARKS]
        if unknown:
            ap.error(f"unknown benchmark(s) {unknown}; choose from {names}")
        names = wanted
    args.out_dir.mkdir(parents=True, exist_ok=True)
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": git_commit(), "quick": args.quick, "machine": machine(),
              "openmp_wait": describe(child_env())}
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        if run_one(name, BENCHMARKS[name] if args.quick else [], args.out_dir, header, args.timeout) != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
