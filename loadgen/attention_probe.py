"""One prompt through a transformers model with eager attention: the attention each token receives, and the
next-token distribution of the prompt's last token when some earlier tokens are evicted.

The prompt minus its last token is prefilled once; a forward hook on every attention module folds the layer's
attention weights into one score per key (summed over heads and queries) as they are produced, since keeping
them all (`output_attentions=True`: layers x heads x tokens^2 floats, ~10 GiB at 3k tokens for SmolLM2) does
not fit. The last token then runs on a copy of that cache with its attention mask zero at the evicted
positions: in every layer it attends only the kept keys, while the kept keys themselves are as the full
prefill computed them (what a cache that evicts after prefill holds)."""

from __future__ import annotations

import copy
import inspect

import torch


class AttentionProbe:
    def __init__(self, model, token_ids: list[int]) -> None:
        if len(token_ids) < 2:
            raise ValueError("the prompt needs at least two tokens (a prefix and the query)")
        self.model = model
        self.ids = torch.tensor([token_ids])
        self.num_tokens = len(token_ids)
        parameters = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"  # transformers 5 renamed it
        self.scores: torch.Tensor | None = None
        self._cache = None

    @classmethod
    def load_model(cls, path):
        """A transformers causal LM from an HF folder, fp32, eager attention (it returns the weights)."""
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                    dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Runs all tokens but the last; returns the attention each token received ([num_tokens], the last
        one 0: it is the query, not yet a key)."""
        scores = torch.zeros(self.num_tokens, dtype=torch.float64)

        def accumulate(module, args, output):
            weights = output[1]
            if weights is None:
                raise RuntimeError("the attention module returned no weights; load the model with eager attention")
            scores[: weights.shape[-1]] += weights.sum(dim=(0, 1, 2), dtype=torch.float64)

        hooks = [layer.self_attn.register_forward_hook(accumulate) for layer in self._decoder_layers()]
        try:
            out = self.model(input_ids=self.ids[:, :-1], use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        self._cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
        self.scores = scores
        return scores

    @torch.inference_mode()
    def final_logits(self, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits of the last token attending only the kept tokens (bool [num_tokens]; None: all)."""
        if self._cache is None:
            self.prefill()
        mask = torch.ones(1, self.num_tokens, dtype=torch.long)
        if kept is not None:
            kept = torch.as_tensor(kept, dtype=torch.bool)
            if kept.shape != (self.num_tokens,) or not kept[-1]:
                raise ValueError("the kept mask needs one entry per token, and the last token (the query) kept")
            mask[0] = kept.long()
        out = self.model(input_ids=self.ids[:, -1:], attention_mask=mask,
                         position_ids=torch.tensor([[self.num_tokens - 1]]), use_cache=True,
                         **{self._cache_arg: copy.deepcopy(self._cache)})
        return out.logits[0, -1].float()

    def _decoder_layers(self):
        return self.model.model.layers


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) of the two next-token distributions, in nats."""
    reference = torch.log_softmax(reference_logits.double(), -1)
    other = torch.log_softmax(logits.double(), -1)
    return max(0.0, float(torch.nn.functional.kl_div(other, reference, log_target=True, reduction="sum")))
