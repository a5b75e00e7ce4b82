"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8 sequence is held back,
and so is any tail that could still grow into a stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, all_output_ids: list[int]) -> str:
        """Feed the output ids so far (one more than last time); return the newly releasable text."""
        prefix = self._decode(all_output_ids[self._prefix_offset:self._read_offset])
        full = self._decode(all_output_ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(all_output_ids)
            self._append(new)
        return self._release(final=self.stopped)

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, start)) != -1]
        if hits:
            at, s = min(hits)  # the earliest stop string wins
            self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
            self.stopped = True

    def flush(self) -> str:
        """Release everything left (the request finished)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
