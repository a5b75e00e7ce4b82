"""The reclaim analysis as a markdown table and a plot (tokens evicted vs blocks freed, and first-token KL),
drawn from the result object of loadgen.reclaim."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_LINESTYLES = {"streaming": "-", "h2o": "--"}
_LABELS = {"streaming": "StreamingLLM (sinks + recent)", "h2o": "H2O (heavy hitters + recent)"}
KL_FLOOR = 1e-6  # the plot's log axis shows a KL of 0 here


def render_markdown(result: dict) -> str:
    sizes = [str(bs) for bs in result["block_sizes"]]
    prompt = "chat prompt: text + question" if result["chat"] else "text alone"
    lines = [
        f"Reclaim: {result['model']}, {result['prompt_tokens']:,}-token prompt from {result['text']} ({prompt}); "
        f"streaming keeps {result['sinks']} sinks, h2o keeps {result['recent_share']:g} of its budget recent.",
        "",
        "| policy | keep | tokens evicted | " + " | ".join(f"blocks freed (bs {bs})" for bs in sizes)
        + " | first-token KL | top-1 same |",
        "|---|---:|---:|" + "---:|" * len(sizes) + "---:|:---:|",
    ]
    for row in result["rows"]:
        freed = " | ".join(f"{100 * row['blocks_freed_fraction'][bs]:.1f}%" for bs in sizes)
        lines.append(f"| {row['policy']} | {row['keep_ratio']:g} | {100 * row['tokens_evicted_fraction']:.1f}% | "
                     f"{freed} | {row['first_token_kl']:.4f} | {'yes' if row['top1_agrees'] else 'no'} |")
    return "\n".join(lines) + "\n"


def plot_reclaim(result: dict, path: Path) -> None:
    rows = result["rows"]
    policies = list(dict.fromkeys(row["policy"] for row in rows))
    sizes = [str(bs) for bs in result["block_sizes"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (blocks_ax, kl_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    for policy in policies:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["tokens_evicted_fraction"])
        evicted = [100 * r["tokens_evicted_fraction"] for r in mine]
        for i, bs in enumerate(sizes):
            blocks_ax.plot(evicted, [100 * r["blocks_freed_fraction"][bs] for r in mine],
                           _LINESTYLES.get(policy, ":"), marker="o", markersize=3, color=colors[i % len(colors)],
                           label=f"{policy}, block {bs}")
        kl_ax.plot(evicted, [max(r["first_token_kl"], KL_FLOOR) for r in mine], _LINESTYLES.get(policy, ":"),
                   marker="o", markersize=3, color="black" if policy == "streaming" else "tab:red",
                   label=_LABELS.get(policy, policy))
    blocks_ax.plot([0, 100], [0, 100], color="grey", linewidth=0.8, linestyle=":", label="blocks = tokens")
    blocks_ax.set(xlabel="tokens evicted (%)", ylabel="KV blocks freed (%)", xlim=(0, 100), ylim=(0, 100),
                  title="What eviction returns to a paged pool")
    blocks_ax.legend(fontsize=7, ncol=2)
    kl_ax.set_yscale("log")
    kl_ax.set(xlabel="tokens evicted (%)", ylabel="first-token KL vs keeping all (nats)", xlim=(0, 100),
              title=f"{result['prompt_tokens']:,}-token prompt, {result['model']}")
    kl_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
