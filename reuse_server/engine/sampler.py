"""Turn a batch of next-token logits into tokens: penalties and logit bias, grammar masks (constrained
output), then greedy, temperature, top-k, top-p, per-request seeds.

What a request's sampling remembers from one token to the next (its seeded generator, its grammar matcher)
is a SamplerState that hangs on the request (Sequence.sampling): it lives and goes with the request, and a
preempted request keeps it, as it keeps its output tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from reuse_server.engine.sampling_params import SamplingParams
from reuse_server.engine.structured_output import GrammarMatchers
from reuse_server.model import cpu_ops


@dataclass(eq=False)
class SamplerState:
    """One request's sampling state, written by the sampler alone."""

    request_id: str = ""  # for the log only
    generator: torch.Generator | None = None  # made from the seed at the first sampled token
    matcher: Any = field(default=None, repr=False)  # the grammar's xgrammar matcher, made at the first token
    unconstrained: bool = False  # the grammar refused a sampled token: the rest goes unconstrained


class Sampler:
    def __init__(self) -> None:
        self._grammars = GrammarMatchers()
        self._ops = cpu_ops.load()  # the native argmax, where the kernels are built

    @staticmethod
    def _generator(state: SamplerState, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        if state.generator is None:
            state.generator = torch.Generator().manual_seed(params.seed)
        return state.generator

    def sample(self, logits: torch.Tensor, states: list[SamplerState], params: list[SamplingParams],
               histories: list[tuple[list[int], list[int]]] | None = None) -> list[int]:
        """logits: [N, vocab] fp32 on any device; states: per row its request's SamplerState (kept by the
        caller from one token to the next); histories: per row (prompt ids, output ids so far), needed when a
        row's params have penalties. Returns one token id per row."""
        logits = logits.float().cpu()
        constrained = any(p.grammar is not None for p in params)
        if constrained or any(p.adjusts_logits for p in params):
            logits = logits.clone()
            for row, p in enumerate(params):
                if p.adjusts_logits:
                    prompt_ids, output_ids = histories[row] if histories is not None else ([], [])
                    adjust_logits(logits[row], p, prompt_ids, output_ids)
        if constrained:
            self._grammars.mask_(logits, states, [p.grammar for p in params])
        out: list[int] = []
        greedy = self._ops.argmax(logits) if self._ops is not None and self._ops.takes(logits) else \
            logits.argmax(dim=-1).tolist()
        for row, (state, p) in enumerate(zip(states, params)):
            if p.greedy:
                out.append(greedy[row])
                continue
            out.append(self._sample_row(logits[row], p, self._generator(state, p)))
        if constrained:
            for state, p, token in zip(states, params, out):
                if p.grammar is not None:
                    self._grammars.accept(state, token)
        return out

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        # a logit taken to +inf (a seen token's logit divided by a repetition_penalty of 1e-46, whose float32
        # is 0) would make the softmax NaN: the largest finite value keeps such tokens the most likely ones
        row = torch.clamp(row / p.temperature, max=torch.finfo(row.dtype).max)
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest set whose mass reaches top_p (the token that crosses it stays); the most likely
            # token always stays: a top_p below float32's smallest value compares as 0 and would drop them all
            drop = cumulative - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())


def adjust_logits(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Apply p's repetition, frequency and presence penalties and logit bias to one row of logits, in place."""
    vocab = row.numel()
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.long).unique()
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].to(row.dtype)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)


def top_logprobs(logits: torch.Tensor, token_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of the chosen token and the k most likely alternatives, from the raw logits."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = float(logp[token_id])
    if k <= 0:
        return chosen, []
    values, ids = torch.topk(logp, k)
    return chosen, list(zip(ids.tolist(), values.tolist()))
