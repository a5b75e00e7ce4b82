"""torch.compile's CPU backend (Inductor) on a decode step, against the fused decode it would replace.

Issue #28 asks that maintained tools come first where they measure faster: torch.compile / AOTInductor for the
decode graph before our own fused C++ layers. This builds the bundled SmolLM2's decode step in plain torch, as
favourable to the compiler as a step can be: one sequence, static shapes (a dense K/V cache of --context
positions attended under a mask, the position a tensor, so nothing recompiles). Two weight settings, each
against the engine on the same weights:
- fp32: dense products and head (the GGUF's values), beside the engine with `--weight-dtype fp32`: the same
  bytes on both sides, so what differs is the graph's overhead and kernels;
- int4: torch's own int4 kernel for the layers (`_weight_int4pack_mm_for_cpu`, the bytes our int4 codes take)
  and its int8 one for the head (`_weight_int8pack_mm`, per-row scales: the bytes of our int8 head), beside
  the engine's default int4 weights.
It times the step eager and compiled (Inductor, fullgraph; for fp32 also with Inductor's C++ wrapper, no Python
between its kernels, what AOTInductor packages), then the engine's own step, fused (one native call) and
per-op: median ms a step over --steps greedy steps after a short prompt, --rounds alternating rounds. The
compiled steps' greedy tokens are checked against the eager step's.

    python -m benchmarks.bench_compile [--steps 64] [--rounds 4] [--context 256] [--weights fp32,int4]

Prints one JSON line per figure (`benchmarks.run_all` files them under a header: date, commit, machine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from reuse_server.server.openmp import apply_short_spin


COMPILED = ("inductor", "inductor_cpp_wrapper")


def _int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> int8 codes and one fp32 scale a row, for `_weight_int8pack_mm`."""
    scales = weight.abs().amax(1).clamp_min(1e-12) / 127
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


class DenseLinear:
    """y = x W^T on fp32 weights (the GGUF's values, dequantized once)."""

    def __init__(self, weight):
        self.weight = weight.dequantize(torch.float32).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TorchDecode:
    """One decode step of a Llama-family model (SmolLM2's switches: no q/k norms, SiLU, tied head) in torch ops
    alone, over a dense K/V cache of `context` positions. weights "fp32": dense products and head; "int4": torch's
    int4 kernel for the layers and its int8 one for the head."""

    def __init__(self, model, context: int, weights: str):
        from reuse_server.model.quant_linear import TorchInt4Linear
        from reuse_server.model.quant_weights import stack

        product = TorchInt4Linear if weights == "int4" else DenseLinear
        self.int8_head = weights == "int4"
        cfg = self.config = model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(dict(
                input_norm=layer.input_layernorm.weight.detach().float(),
                post_norm=layer.post_attention_layernorm.weight.detach().float(),
                qkv=product(stack([attn.q_proj.qweight, attn.k_proj.qweight, attn.v_proj.qweight])),
                o=product(attn.o_proj.qweight),
                gate_up=product(stack([mlp.gate_proj.qweight, mlp.up_proj.qweight])),
                down=product(mlp.down_proj.qweight)))
        self.norm = model.norm.weight.detach().float()
        table = model.embed_tokens.qweight.dequantize(torch.float32)
        self.embedding = table
        self.head_codes, self.head_scales = _int8_rows(table)
        cos, sin = model.rotary.table(context)
        self.cos, self.sin = cos.contiguous(), sin.contiguous()
        shape = (cfg.num_layers, context, self.kv_heads, self.head_dim)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.positions = torch.arange(context)

    def step(self, token: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
             ) -> torch.Tensor:
        """token, pos: [1] int64 -> logits [1, vocab]; writes the token's K/V at pos in every layer."""
        cfg, hd = self.config, self.head_dim
        hidden = F.embedding(token, self.embedding)
        cos, sin = self.cos[pos], self.sin[pos]  # [1, hd]
        visible = (self.positions <= pos).view(1, 1, -1)  # the cache's positions this token attends to
        group = self.heads // self.kv_heads
        for i, w in enumerate(self.layers):
            x = F.rms_norm(hidden, (cfg.hidden_size,), w["input_norm"], cfg.rms_norm_eps)
            q, k, v = w["qkv"](x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
            q, k = _rope(q.view(1, self.heads, hd), cos, sin), _rope(k.view(1, self.kv_heads, hd), cos, sin)
            k_cache[i].index_copy_(0, pos, k)
            v_cache[i].index_copy_(0, pos, v.view(1, self.kv_heads, hd))
            keys, values = k_cache[i].transpose(0, 1), v_cache[i].transpose(0, 1)  # [kv_heads, context, hd]
            scores = q.view(self.kv_heads, group, hd) @ keys.transpose(1, 2) * cfg.attention_scale
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            attended = (probs @ values).reshape(1, self.heads * hd)
            hidden = hidden + w["o"](attended)
            x = F.rms_norm(hidden, (cfg.hidden_size,), w["post_norm"], cfg.rms_norm_eps)
            gate, up = w["gate_up"](x).chunk(2, -1)
            hidden = hidden + w["down"](F.silu(gate) * up)
        hidden = F.rms_norm(hidden, (cfg.hidden_size,), self.norm, cfg.rms_norm_eps)
        if self.int8_head:
            return torch.ops.aten._weight_int8pack_mm(hidden, self.head_codes, self.head_scales)
        return F.linear(hidden, self.embedding)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def time_steps(step, prompt: list[int], steps: int, cache) -> tuple[float, list[int]]:
    """Feeds the prompt a token at a time, then `steps` greedy tokens: median ms of those steps, the tokens."""
    k_cache, v_cache = cache
    k_cache.zero_(), v_cache.zero_()
    token, times, out = None, [], []
    with torch.inference_mode():
        for pos in range(len(prompt) + steps):
            ids = torch.tensor([prompt[pos] if pos < len(prompt) else token])
            start = time.perf_counter()
            logits = step(ids, torch.tensor([pos]), k_cache, v_cache)
            token = int(logits.argmax())
            if pos >= len(prompt):
                times.append(time.perf_counter() - start)
                out.append(token)
    return 1e3 * statistics.median(times), out


def engine_steps(engine, prompt: list[int], steps: int, fused: bool) -> tuple[float, list[int]]:
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams

    model = engine.runner.model
    model.use_fused_decode(fused)
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                                            ignore_eos=True),
                       CacheOptions(prefix_cache=False))
    times, out = [], []
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        out += [t for o in outputs for t in o.new_token_ids]
    model.use_fused_decode(True)
    return 1e3 * statistics.median(times[1:]), out[1:]  # the first step is the prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=256, help="the dense cache's positions (prompt + steps fit)")
    ap.add_argument("--weights", default="fp32,int4", help="fp32: dense on both sides; int4: torch's int4 kernel")
    args = ap.parse_args()
    apply_short_spin()
    import torch._inductor.config as inductor_config

    from reuse_server.engine.builder import build_engine
    from reuse_server.engine.config import EngineConfig
    from reuse_server.model import load_model, resolve_model

    def record(**row):
        print(json.dumps(row), flush=True)

    record(bench="compile_setup", torch=torch.__version__, steps=args.steps, rounds=args.rounds,
           context=args.context)
    model, _ = load_model(resolve_model("bundled", "int4"), weight_dtype="int4")
    for weights in args.weights.split(","):
        decode = TorchDecode(model, args.context, weights)
        engine = build_engine(EngineConfig(weight_dtype=weights, kv_cache_memory=384 << 20))
        prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper who finds a map in a bottle.")
        cache = (decode.k_cache, decode.v_cache)
        variants = {"torch_eager": decode.step}
        for name in COMPILED if weights == "fp32" else COMPILED[:1]:
            inductor_config.cpp_wrapper = name == "inductor_cpp_wrapper"
            torch._dynamo.reset()
            start = time.perf_counter()
            variants[name] = torch.compile(decode.step, fullgraph=True, dynamic=False)
            time_steps(variants[name], prompt, 2, cache)  # compiles
            record(bench="compile_time", weights=weights, variant=name, seconds=round(time.perf_counter() - start, 1))
        runs = {name: (lambda step=step: time_steps(step, prompt, args.steps, cache)) for name, step in variants.items()}
        runs["ours_fused"] = lambda: engine_steps(engine, prompt, args.steps, True)
        runs["ours_per_op"] = lambda: engine_steps(engine, prompt, args.steps, False)
        times = {name: [] for name in runs}
        tokens = {}
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                ms, out = runs[name]()
                times[name].append(ms)
                tokens[name] = out
        for name, values in times.items():
            record(bench="decode_step", weights=weights, variant=name, median_ms=round(statistics.median(values), 2),
                   rounds_ms=[round(v, 2) for v in values])
        record(bench="tokens", weights=weights,
               compiled_as_eager=all(tokens[name] == tokens["torch_eager"] for name in variants),
               fused_as_per_op=tokens["ours_fused"] == tokens["ours_per_op"],
               torch_as_ours=sum(a == b for a, b in zip(tokens["torch_eager"], tokens["ours_fused"])))
        del engine, decode, variants, runs


if __name__ == "__main__":
    main()
