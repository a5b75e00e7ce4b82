"""Constrained decoding: a request's output is held to a grammar (a JSON schema, or the tool-call format
of api/tools.py) by masking, before each sampled token, every token the grammar does not allow next.

- `GrammarCompiler` turns a `Constraint` into an xgrammar grammar for the served tokenizer. Compiling
  takes milliseconds to seconds, so the HTTP handler calls it off the engine thread; compiled grammars
  are kept in xgrammar's own cache, keyed by the constraint's text, so an agent that sends the same
  tools or schema on every step compiles them once.
- `GrammarMatchers` (the sampler's grammar step) makes one matcher per constrained request, kept in the
  request's SamplerState, fills one bitmask for all of a batch's constrained rows and applies it to their
  logits in one operation, and advances a request's matcher by each token sampled for it. A preempted
  request keeps its output tokens, so its matcher stays valid; it goes when the request goes.
- Text the grammar forces (a tool call's `<tool_call>\n{"name": "f", "arguments": `) is written in the
  tokenizer's own tokens: the mask lets through only the first token of the forced text's tokenization,
  not every prefix of it. A model left to choose splits it its own way (`s`, `ear`, `ch` for `search`);
  the client sends the call back as text, which the next prompt tokenizes the usual way, and the prefix
  cache matches only as far as both agree. The forced text's last token is left to the model: it may merge
  with what follows.

xgrammar rather than llguidance: both install without touching torch, and on SmolLM2's 49,152-token
vocabulary xgrammar filled a row's mask several times faster (benchmarks/bench_structured.py). Its own
CPU routine for applying masks was slower than a byte lookup table in torch, so masks are applied here.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from reuse_server.engine.sampling_params import InvalidRequest

log = logging.getLogger(__name__)

# Compiled grammars kept per server (xgrammar's cache, least recently used out first).
GRAMMAR_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. `text` is the JSON schema or xgrammar structural tag as JSON text;
    property order matters (the output follows the schema's order), so it is not normalized."""

    kind: Literal["json_schema", "json_object", "structural_tag"]
    text: str
    param: str  # the request field it came from, for error messages


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint, with the tokenizer's encoder for the text it forces."""

    compiled: Any  # xgrammar.CompiledGrammar
    encode: Callable[[str], list[int]]


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe; the xgrammar tokenizer table is built at the
    first compile (it walks the whole vocabulary), not at server start."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def _xgr_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # xgrammar reads transformers' tokenizer; the server's own (model/tokenizer.py) loads it now
                hf = getattr(self._tokenizer, "transformers_tokenizer", None)
                info = xgr.TokenizerInfo.from_huggingface(hf() if hf else self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                                     cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    def compile(self, constraint: Constraint) -> Grammar:
        """The compiled grammar; InvalidRequest (a 400) when the schema or tag cannot be compiled."""
        compiler = self._xgr_compiler()
        try:
            if constraint.kind == "structural_tag":
                compiled = compiler.compile_structural_tag(constraint.text)
            else:
                # One line with ", " and ": " (as json.dumps writes it): a small model given free whitespace can
                # spend its whole budget on newlines.
                compiled = compiler.compile_json_schema(constraint.text, any_whitespace=False,
                                                        strict_mode=constraint.kind == "json_schema")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequest(f"{constraint.param}: cannot use this schema: {_library_message(exc)}",
                                 constraint.param) from None
        return Grammar(compiled, self._encode)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _library_message(exc: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source location; the client needs the rest."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[0-9:]+\] [^ ]+:[0-9]+: ", "", text)


def _byte_bias() -> torch.Tensor:
    """[256, 8]: for each byte of a bitmask, 0 for the tokens its bits allow and -inf for the others
    (bit j of a byte is the token 8 x byte + j, as xgrammar packs them)."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))


_BYTE_BIAS = _byte_bias()
_BYTE_BIAS_ON: dict[torch.device, torch.Tensor] = {torch.device("cpu"): _BYTE_BIAS}


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of logits[rows[i]] whose bit is 0 in bitmask[i] (int32 words, 32
    tokens each). One lookup and one add for all rows."""
    vocab, device = logits.shape[1], logits.device
    # xgrammar fills the mask on the host; it goes to the logits' device in one copy (the table once per device)
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).long().to(device), _byte_bias_on(device))
    bias = bias.view(len(rows), -1)[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.add_(bias)
    else:
        index = torch.tensor(rows, dtype=torch.long).to(device)
        logits.index_put_((index,), logits[index] + bias)


def _byte_bias_on(device: torch.device) -> torch.Tensor:
    if device not in _BYTE_BIAS_ON:
        _BYTE_BIAS_ON[device] = _BYTE_BIAS.to(device)
    return _BYTE_BIAS_ON[device]


def _only_canonical_token(matcher, encode: Callable[[str], list[int]], row: torch.Tensor) -> bool:
    """Narrow the row's mask to the first token of the forced text's own tokenization, if the grammar forces
    text that takes more than one token; whether it did."""
    forced = matcher.find_jump_forward_string()
    if not forced:
        return False
    tokens = encode(forced)
    if len(tokens) < 2:
        return False
    word, bit = divmod(tokens[0], 32)
    if word >= row.numel() or not (int(row[word]) >> bit) & 1:  # not a token the grammar allows: leave it be
        return False
    row.zero_()
    row[word] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # as an int32
    return True


class GrammarMatchers:
    """The grammar step of the sampler. Each request's matcher lives in its SamplerState (sampler.py), on the
    request itself; this only makes, masks and advances them."""

    @staticmethod
    def _matcher(state, grammar: Grammar):
        if state.unconstrained:
            return None
        if state.matcher is None:
            import xgrammar as xgr

            state.matcher = xgr.GrammarMatcher(grammar.compiled)
        return state.matcher

    def mask_(self, logits: torch.Tensor, states: list, grammars: list[Grammar | None]) -> None:
        """Mask, in place, the rows whose grammar is not None (and not already complete); states: per row its
        request's SamplerState."""
        rows, matchers, encoders = [], [], []
        for row, (state, grammar) in enumerate(zip(states, grammars)):
            if grammar is None:
                continue
            matcher = self._matcher(state, grammar)
            if matcher is not None and not matcher.is_terminated():
                rows.append(row)
                matchers.append(matcher)
                encoders.append(grammar.encode)
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
        masked = []
        for i, (matcher, encode) in enumerate(zip(matchers, encoders)):
            # a row whose grammar allows every token now (free text before a tool call) needs no mask
            if matcher.fill_next_token_bitmask(bitmask, i) | _only_canonical_token(matcher, encode, bitmask[i]):
                masked.append(i)
        if masked:
            apply_bitmask_(logits, bitmask[masked] if len(masked) < len(rows) else bitmask, [rows[i] for i in masked])

    @staticmethod
    def accept(state, token: int) -> None:
        matcher = None if state.unconstrained else state.matcher
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            # Only a token the mask allowed is sampled; if the matcher still refuses it, generation goes on
            # unconstrained rather than failing the request.
            log.warning("request %s: the grammar refused token %d; no longer constrained", state.request_id, token)
            state.matcher, state.unconstrained = None, True
