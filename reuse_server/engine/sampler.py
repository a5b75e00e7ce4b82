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


@dataclass
class Picked:
    """A step's sampling, on the host: per row its token, and where the row's params ask for logprobs, (the
    token's log-probability, the k most likely (id, log-probability)), from the raw logits."""

    tokens: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples on the logits' device: every adjustment, mask and draw is a device op, and the step's results
    (tokens, and logprobs where asked) come to the host in one copy at the end (`_to_host`)."""

    def __init__(self) -> None:
        self._grammars = GrammarMatchers()
        self._ops = cpu_ops.load()  # the native argmax, where the kernels are built

    @staticmethod
    def _generator(state: SamplerState, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        if state.generator is None:
            state.generator = torch.Generator(device=device).manual_seed(params.seed)
        return state.generator

    def sample(self, logits: torch.Tensor, states: list[SamplerState], params: list[SamplingParams],
               histories: list[tuple[list[int], list[int]]] | None = None) -> list[int]:
        """pick's tokens alone."""
        return self.pick(logits, states, params, histories).tokens

    def pick(self, logits: torch.Tensor, states: list[SamplerState], params: list[SamplingParams],
             histories: list[tuple[list[int], list[int]]] | None = None) -> Picked:
        """logits: [N, vocab] on any device; states: per row its request's SamplerState (kept by the caller
        from one token to the next); histories: per row (prompt ids, output ids so far), needed when a row's
        params have penalties. Returns one token per row and the logprobs the rows' params ask for."""
        raw = logits = logits[:len(params)].float()  # a row per params
        constrained = any(p.grammar is not None for p in params)
        if constrained or any(p.adjusts_logits for p in params):
            logits = logits.clone()
            for row, p in enumerate(params):
                if p.adjusts_logits:
                    prompt_ids, output_ids = histories[row] if histories is not None else ([], [])
                    adjust_logits(logits[row], p, prompt_ids, output_ids)
        if constrained:
            self._grammars.mask_(logits, states, [p.grammar for p in params])
        asking = [row for row, p in enumerate(params) if p.logprobs is not None]
        if self._ops is not None and self._ops.takes(logits):
            greedy = self._ops.argmax(logits)  # on the host already
            if not asking and all(p.greedy for p in params):  # a CPU decode's usual step: nothing more to do
                if constrained:
                    self._accept(states, params, greedy)
                return Picked(greedy, [None] * len(greedy))
            tokens = torch.tensor(greedy, dtype=torch.long)
        else:
            tokens = logits.argmax(dim=-1)
        for row, (state, p) in enumerate(zip(states, params)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, self._generator(state, p, logits.device))
        picked = _to_host(tokens, raw, asking, max((params[row].logprobs for row in asking), default=0))
        if constrained:
            self._accept(states, params, picked.tokens)
        for row in asking:  # each row's own k of the largest asked for
            chosen, top = picked.logprobs[row]
            picked.logprobs[row] = (chosen, top[:max(0, params[row].logprobs)])
        return picked

    def _accept(self, states: list[SamplerState], params: list[SamplingParams], tokens: list[int]) -> None:
        """Advance each constrained row's grammar by its token."""
        for state, p, token in zip(states, params, tokens):
            if p.grammar is not None:
                self._grammars.accept(state, token)

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
        """The token drawn for one row, as a 0-dim tensor on the row's device."""
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
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=gen)[0]


def _to_host(tokens: torch.Tensor, raw: torch.Tensor, asking: list[int], k: int) -> Picked:
    """The step's one device-to-host copy: the tokens [N] and, for the rows `asking`, the chosen token's
    log-probability and the k most likely, packed into one float64 tensor (token ids are exact in it)."""
    if not asking:  # the ids alone: no packing
        return Picked(tokens.tolist(), [None] * tokens.shape[0])
    parts = [tokens.to(torch.float64)]
    if asking:
        if len(asking) == raw.shape[0]:  # every row (a batch of one; requests alike): no gather
            chosen_rows, asked = raw, tokens
        else:
            rows = torch.tensor(asking, dtype=torch.long).to(raw.device, non_blocking=True)
            chosen_rows, asked = raw.index_select(0, rows), tokens.index_select(0, rows)
        logp = torch.log_softmax(chosen_rows, dim=-1)
        parts.append(logp.gather(1, asked[:, None]).to(torch.float64).flatten())
        if k > 0:
            values, ids = torch.topk(logp, k)
            parts += [values.to(torch.float64).flatten(), ids.to(torch.float64).flatten()]
    host = torch.cat(parts).cpu().tolist()
    n, m = tokens.shape[0], len(asking)
    out = Picked([int(t) for t in host[:n]], [None] * n)
    values, ids = host[n + m:n + m + m * k], host[n + m + m * k:]
    for i, row in enumerate(asking):
        top = [(int(ids[i * k + j]), values[i * k + j]) for j in range(k)]
        out.logprobs[row] = (host[n + i], top)
    return out


def adjust_logits(row: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
    """Apply p's repetition, frequency and presence penalties and logit bias to one row of logits, in place."""
    vocab = row.numel()
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(prompt_ids + output_ids, dtype=torch.long).unique().to(row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].to(row)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long).to(row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype).to(row.device)
