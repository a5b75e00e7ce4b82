"""--cuda-graphs: one CUDA graph of the decode step per batch-size bucket, captured at start on the static
input buffers (decode_inputs.py) and replayed for plain decode steps: a decode step of a small model is
mostly kernel launches, which a replay issues as one. Prefill, mixed steps and blending run eagerly.

As nano-vllm's capture_cudagraph and vLLM's: buckets captured from the largest down, all in one memory pool
(a smaller bucket's activations fit in what the larger one's left), each after a warm-up run that compiles the
Triton kernels for its shapes; the step's logits come out in a tensor the graph owns, whose first rows are
the step's. Off by default until measured (BENCHMARKS.md, GPU: decode graphs on against off)."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def static_decode_problem(pool) -> str | None:
    """Why a pool's decode steps cannot run on static buffers, or None. A hybrid model's layered pool routes
    its window layers through block ids of their own, built per step (LayeredKVPool.route)."""
    if pool.layered:
        return ("a hybrid model's layered pool (its sliding-window layers' KV apart) maps block ids per step; "
                "--window-kv-share 0 keeps one pool for every layer")
    return None


class DecodeGraphs:
    """The captured graphs, by bucket, and the logits each writes."""

    def __init__(self, graphs: dict[int, "torch.cuda.CUDAGraph"], logits: dict[int, torch.Tensor],
                 memory_bytes: int):
        self._graphs = graphs
        self._logits = logits
        self.memory_bytes = memory_bytes  # device memory the capture took (activations, logits, workspaces)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def holds(self, bucket: int) -> bool:
        return bucket in self._graphs

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's step on what the static buffers hold now; its logits [bucket, vocab]."""
        self._graphs[bucket].replay()
        return self._logits[bucket]

    @classmethod
    @torch.inference_mode()
    def capture(cls, model, pool, inputs) -> "DecodeGraphs":
        """A graph per bucket of `inputs` (StaticDecodeInputs), each captured on a step of padding rows (their
        K/V goes to the scratch block, the only block they touch)."""
        if inputs.device.type != "cuda":
            raise ValueError(f"CUDA graphs are captured on a CUDA device, not {inputs.device}")
        problem = static_decode_problem(pool)
        if problem:
            raise ValueError(f"--cuda-graphs: {problem}")
        torch.cuda.synchronize(inputs.device)
        free_before = torch.cuda.mem_get_info(inputs.device)[0]
        graphs, logits, memory = {}, {}, None
        for bucket in reversed(inputs.buckets):
            step = inputs.padding(bucket, model.backend.attention)

            def forward(step=step):
                hidden = model(step.input_ids, step.positions, step.meta, pool, None)
                return model.compute_logits(hidden)

            forward()  # warm-up: Triton compiles for these shapes, torch settles its workspaces
            torch.cuda.synchronize(inputs.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=memory):
                    logits[bucket] = forward()
            except Exception as exc:  # one line at start rather than a trace from inside the capture
                raise ValueError(f"--cuda-graphs could not capture the decode step of {bucket} rows: {exc}") from exc
            memory = graph.pool() if memory is None else memory
            graphs[bucket] = graph
        torch.cuda.synchronize(inputs.device)
        taken = free_before - torch.cuda.mem_get_info(inputs.device)[0]
        log.info("CUDA graphs of the decode step captured for batches of %s rows: %.0f MiB of device memory",
                 ", ".join(map(str, sorted(graphs))), taken / 2**20)
        return cls(graphs, logits, taken)
