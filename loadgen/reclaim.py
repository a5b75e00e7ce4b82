"""`reuse-loadgen reclaim`: what token eviction really gives back to a paged KV pool.

A compression method that keeps 20% of a prompt's tokens reads like an 80% memory saving, but a paged pool
returns only blocks whose every slot is evicted. This runs a real prompt through the model (transformers,
eager attention), takes the attention every token received, applies the eviction policies of loadgen.eviction
at several keep ratios, and reports per policy and ratio: the fraction of tokens evicted, the fraction of
blocks freed at each block size, and the first-token KL (and top-1 agreement) of the next-token distribution
with the evicted tokens masked out in every layer, against keeping everything. Writes NAME.json, NAME.md
and NAME.png into --out."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from loadgen.errors import UsageError
from loadgen.eviction import POLICIES, blocks_freed, kept_tokens
from loadgen.run import fraction, non_negative_int, positive_int

DEFAULT_KEEP_RATIOS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
DEFAULT_BLOCK_SIZES = "1,16,64,256"
DEFAULT_QUESTION = "Summarize the text above in one sentence."


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "reclaim", help="tokens evicted vs KV blocks freed (and first-token KL) for StreamingLLM and H2O eviction",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", required=True, type=Path, help="a text file: the prompt's document")
    p.add_argument("--model", default="smollm2",
                   help="the bundled model 'smollm2', a .gguf file or a Hugging Face folder (default: smollm2)")
    p.add_argument("--question", default=DEFAULT_QUESTION,
                   help="asked after the text in a chat prompt (the chat template's user turn); the first answer "
                        "token is the one whose distribution is compared (default: %(default)r)")
    p.add_argument("--no-chat", action="store_true", help="use the text alone, no chat template and no question")
    p.add_argument("--max-tokens", type=positive_int, default=4096,
                   help="cut the text so that the prompt has at most this many tokens (default: 4096)")
    p.add_argument("--policies", type=_policies, default=",".join(POLICIES),
                   help=f"comma-separated, of {', '.join(POLICIES)} (default: all)")
    p.add_argument("--keep-ratios", type=_ratios, default=DEFAULT_KEEP_RATIOS,
                   help=f"fractions of the tokens kept (default: {DEFAULT_KEEP_RATIOS})")
    p.add_argument("--block-sizes", type=_block_sizes, default=DEFAULT_BLOCK_SIZES,
                   help=f"tokens per KV block (default: {DEFAULT_BLOCK_SIZES})")
    p.add_argument("--sinks", type=non_negative_int, default=4,
                   help="streaming: attention-sink tokens kept at the start (default: 4)")
    p.add_argument("--recent-share", type=fraction, default=0.5,
                   help="h2o: share of the budget kept as the most recent tokens, the rest heavy hitters "
                        "(default: 0.5)")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for the outputs (default: .)")
    p.add_argument("--name", default="reclaim", help="file name stem of the outputs (default: reclaim)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        text = args.text.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --text {args.text}: {exc}") from None
    if not text.strip():
        raise UsageError(f"--text {args.text} is empty")

    from reuse_server.server.openmp import apply_short_spin

    apply_short_spin()  # before torch loads: a shared CPU's other processes keep their cores (see openmp.py)
    import torch  # the heavy imports wait until the flags are known to be good

    from loadgen.attention_probe import AttentionProbe, first_token_kl
    from loadgen.reclaim_report import plot_reclaim, render_markdown
    from reuse_server.model import load_tokenizer, resolve_model
    from reuse_server.model.errors import ModelLoadError

    try:
        path = resolve_model(args.model)
        tokenizer = load_tokenizer(path)
        model = AttentionProbe.load_model(path)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise UsageError(f"cannot load the model {args.model!r}: {exc}") from None
    ids = prompt_ids(tokenizer, text, None if args.no_chat else args.question, args.max_tokens)
    probe = AttentionProbe(model, ids)
    started = time.perf_counter()
    scores = probe.prefill().numpy()
    reference = probe.final_logits()
    rows = []
    for policy in args.policies:
        for ratio in args.keep_ratios:
            kept = kept_tokens(policy, ratio, scores, sinks=args.sinks, recent_share=args.recent_share)
            logits = probe.final_logits(torch.from_numpy(kept))
            rows.append(reclaim_row(policy, ratio, kept, args.block_sizes, first_token_kl(reference, logits),
                                    int(logits.argmax()) == int(reference.argmax())))
    result = {
        "model": str(args.model), "text": str(args.text), "prompt_tokens": len(ids),
        "chat": not args.no_chat, "question": None if args.no_chat else args.question,
        "block_sizes": list(args.block_sizes), "sinks": args.sinks, "recent_share": args.recent_share,
        "top_attention_tokens": [int(i) for i in np.argsort(-scores, kind="stable")[:8]],
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = render_markdown(result)
    stem.with_suffix(".md").write_text(markdown)
    plot_reclaim(result, stem.with_suffix(".png"))
    print(markdown)
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0


def reclaim_row(policy: str, keep_ratio: float, kept: np.ndarray, block_sizes, kl: float, top1: bool) -> dict:
    evicted = int((~kept).sum())
    freed = {str(bs): blocks_freed(kept, bs) for bs in block_sizes}
    return {
        "policy": policy, "keep_ratio": keep_ratio, "kept_tokens": int(kept.sum()), "evicted_tokens": evicted,
        "tokens_evicted_fraction": evicted / len(kept),
        "blocks_freed": {bs: f for bs, (f, _) in freed.items()},
        "blocks_total": {bs: t for bs, (_, t) in freed.items()},
        "blocks_freed_fraction": {bs: f / t for bs, (f, t) in freed.items()},
        "first_token_kl": kl, "top1_agrees": top1,
    }


def prompt_ids(tokenizer, text: str, question: str | None, max_tokens: int) -> list[int]:
    """The prompt's token ids: the text (cut to fit max_tokens) followed by the question in one chat user
    turn, or the text alone."""
    def render(body: str) -> list[int]:
        if question is None:
            return tokenizer(body, add_special_tokens=False)["input_ids"]
        return tokenizer.apply_chat_template([{"role": "user", "content": f"{body}\n\n{question}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]

    ids = render(text)
    text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = len(text_ids) - (len(ids) - max_tokens)
    while len(ids) > max_tokens:  # decoding a cut and encoding it again can shift a token: cut again until it fits
        if cut < 1:
            raise UsageError(f"--max-tokens {max_tokens} leaves no room for the text")
        ids = render(tokenizer.decode(text_ids[:cut]))
        cut -= max(1, len(ids) - max_tokens)
    if len(ids) < 2:
        raise UsageError("the prompt has fewer than two tokens")
    return ids


def _ratios(text: str) -> tuple[float, ...]:
    return tuple(fraction(part) for part in text.split(","))


def _block_sizes(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    return names
