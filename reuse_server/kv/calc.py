"""`reuse-server kv-calc`: how much KV a model needs, and what fits in a memory budget.

From the model's config alone (reuse_server.kv.kv_geometry) and the one KV formula (reuse_server.kv.layout):
bytes per token and per block, the padding of a sequence's partly filled last block, and what fits in the
memory (the most sequences at the given context, the longest context at the given concurrency), with the
formula written out. Three ways of holding a sequence are counted (kv_layout.ALLOCATIONS): the headline
figures are the paged pool's (whole blocks, windowed layers returning blocks that left their window); `ideal`
(exact tokens) and `paged_all_layers` (every layer keeps the whole context, as one block table shared by all
layers does) are shown where they differ."""

from __future__ import annotations

import json

from reuse_server.kv import layout as kv_layout
from reuse_server.kv.layout import SCALE_BYTES, KVDType, LayerKV
from reuse_server.kv.kv_geometry import ModelKV

SEARCH_LIMIT = 1 << 40  # tokens: past this, a context is taken as unbounded (every layer windowed)
HEADLINE = "paged"


def calculate(model: ModelKV, dtype: KVDType, block_size: int, context: int, concurrency: int,
              memory_bytes: int) -> dict:
    """Every figure kv-calc prints, as one JSON-ready object."""
    geometry = model.geometry
    per_block = kv_layout.bytes_per_block(geometry, dtype, block_size)
    allocations = {}
    for allocation in kv_layout.ALLOCATIONS:
        per_sequence = kv_layout.sequence_bytes(geometry, dtype, block_size, context, allocation)
        by_memory = kv_layout.max_context(geometry, dtype, block_size, concurrency, memory_bytes, allocation,
                                          SEARCH_LIMIT)
        allocations[allocation] = {
            "per_sequence_bytes": _number(per_sequence),
            "max_concurrency": kv_layout.max_concurrency(per_sequence, memory_bytes),
            "max_context_by_memory": by_memory,
        }
    headline = allocations[HEADLINE]
    by_memory = headline["max_context_by_memory"]
    limit = model.max_context
    capped = limit is not None and (by_memory is None or by_memory > limit)
    padding = kv_layout.padding_tokens(context, block_size)
    padding_bytes = allocations["paged"]["per_sequence_bytes"] - allocations["ideal"]["per_sequence_bytes"]
    return {
        "model": model.name,
        "source": model.source,
        "architecture": model.architecture,
        "mla": geometry.mla,
        "num_layers": len(geometry.layers),
        "num_attention_heads": model.num_heads,
        "layer_groups": [{"layers": count, "kv_heads": layer.kv_heads, "k_dim": layer.k_dim, "v_dim": layer.v_dim,
                          "window": layer.window, "blocks_per_sequence": layer.blocks_held(context, block_size)}
                         for layer, count in geometry.groups()],
        "kv_dtype": dtype.name,
        "element_bytes": dtype.element_bytes,
        "scales": _scales_text(dtype),
        "block_size": block_size,
        "bytes_per_token": _number(kv_layout.bytes_per_token(geometry, dtype, block_size)),
        "bytes_per_block": per_block,
        "context": context,
        "concurrency": concurrency,
        "memory_bytes": memory_bytes,
        "pool_blocks": memory_bytes // per_block,
        "per_sequence_bytes": headline["per_sequence_bytes"],
        "padding_tokens_per_sequence": padding,
        "padding_bytes_per_sequence": _number(padding_bytes),
        "padding_bytes": _number(padding_bytes * concurrency),
        "max_concurrency": headline["max_concurrency"],
        "max_context": limit if capped else by_memory,
        "max_context_by_memory": by_memory,
        "model_max_context": limit,
        "context_limited_by": "model" if capped else "memory",
        "allocation": HEADLINE,
        "allocations": allocations,
        "formula": token_formula(model, dtype, block_size),
    }


def token_formula(model: ModelKV, dtype: KVDType, block_size: int) -> str:
    """'2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 B = 46,080 B': one term per group of alike layers."""
    terms = [_term(layer, count, dtype, block_size) for layer, count in model.geometry.groups()]
    value = kv_layout.bytes_per_token(model.geometry, dtype, block_size)
    return f"{' + '.join(terms)} = {_plain(value)}"


def _term(layer: LayerKV, count: int, dtype: KVDType, block_size: int) -> str:
    if layer.v_dim == 0:  # MLA: one latent per token, shared by all heads
        shape, width = f"{count} layers x {layer.kv_heads} latent", layer.k_dim
    elif layer.k_dim == layer.v_dim:
        shape, width = f"2 (K, V) x {count} layers x {layer.kv_heads} KV heads", layer.k_dim
    else:
        shape, width = f"{count} layers x {layer.kv_heads} KV heads", layer.k_dim + layer.v_dim
    if dtype.scale_per == "token":
        element = f"({width} dims x {dtype.element_bytes} B + {SCALE_BYTES} B scale)"
    elif dtype.scale_per == "block":
        element = f"({width} dims x {dtype.element_bytes} B + {SCALE_BYTES} B scale / {block_size} tokens)"
    else:
        element = f"{width} dims x {dtype.element_bytes} B"
    if layer.v_dim == 0 or layer.k_dim == layer.v_dim:
        text = f"{shape} x {element}"
    else:  # K and V of different widths: the scales (one per tensor) are counted apart
        text = f"{shape} x {width} dims x {dtype.element_bytes} B" + (
            f" + 2 x {count} x {layer.kv_heads} scales" if dtype.scale_per else "")
    return text + (f" [window {layer.window:,}]" if layer.window is not None else "")


def render(result: dict) -> str:
    r = result
    lines = [f"{r['model']} ({r['architecture'] or 'unknown architecture'}; config read from {r['source']})"]
    lines += _layout_lines(r)
    scales = r["scales"].replace("K or V, ", "").replace("KV head", "latent") if r["mla"] else r["scales"]
    lines.append(f"KV dtype {r['kv_dtype']}: {r['element_bytes']} B per element, {scales}")
    lines.append("")
    lines.append(f"bytes per token = {r['formula']}")
    lines.append(f"bytes per block = {r['block_size']:,} tokens x {_plain(r['bytes_per_token'])} "
                 f"= {_bytes(r['bytes_per_block'])}")
    lines.append("")
    lines.append(f"At context {r['context']:,}, concurrency {r['concurrency']:,}, memory {_bytes(r['memory_bytes'])}:")
    blocks = sorted({g["blocks_per_sequence"] for g in r["layer_groups"]})
    blocks_text = (f"{blocks[0]:,} blocks" if len(blocks) == 1
                   else f"{min(blocks):,} to {max(blocks):,} blocks per layer")
    windowed = any(g["window"] is not None for g in r["layer_groups"])
    lines.append(f"  one sequence holds {blocks_text} = {_bytes(r['per_sequence_bytes'])}")
    lines.append(f"  padding: the partly filled last block leaves {r['padding_tokens_per_sequence']:,} slots empty"
                 + (" (and a window's first block is partly out of the window)" if windowed else "")
                 + f": {_bytes(r['padding_bytes_per_sequence'])} per sequence"
                 + (f", {_bytes(r['padding_bytes'])} for all {r['concurrency']:,}" if r["concurrency"] > 1 else ""))
    if r["model_max_context"] is not None and r["context"] > r["model_max_context"]:
        lines.append(f"  (the model itself stops at {r['model_max_context']:,} tokens)")
    lines.append(f"  the memory holds {r['pool_blocks']:,} blocks ({_plain(r['memory_bytes'])} // "
                 f"{_plain(r['bytes_per_block'])})")
    lines.append(f"  max concurrency at context {r['context']:,}: {r['max_concurrency']:,} "
                 f"({_plain(r['memory_bytes'])} // {_plain(r['per_sequence_bytes'])} per sequence)")
    lines.append(f"  max context at concurrency {r['concurrency']:,}: {_context_text(r)}")
    lines += _allocation_lines(r)
    return "\n".join(lines)


def _layout_lines(r: dict) -> list[str]:
    groups = r["layer_groups"]
    if r["mla"]:
        return [f"KV layout: MLA, {r['num_layers']} layers x one {groups[0]['k_dim']}-element latent per token "
                f"(kv_lora_rank + qk_rope_head_dim), shared by all {r['num_attention_heads']} heads; no separate V"]
    lines = []
    for g in groups:
        window = f", window {g['window']:,} tokens" if g["window"] is not None else ", full attention"
        lines.append(f"KV layout: {g['layers']} layers x {g['kv_heads']} KV heads x {g['k_dim']} dims, K and V"
                     f"{window}")
    kv_heads = {g["kv_heads"] for g in groups}
    if len(kv_heads) == 1 and r["num_attention_heads"] > min(kv_heads):
        lines.append(f"  grouped-query: {r['num_attention_heads']} attention heads share {min(kv_heads)} KV heads")
    return lines


def _context_text(r: dict) -> str:
    if r["max_context_by_memory"] == 0:
        return "none fits (one block per sequence is more than the memory allows)"
    memory = ("unbounded (every layer is windowed)" if r["max_context_by_memory"] is None
              else f"{r['max_context_by_memory']:,} tokens")
    if r["context_limited_by"] == "model":
        return f"{r['max_context']:,} tokens, the model's limit (memory alone: {memory})"
    return memory


def _allocation_lines(r: dict) -> list[str]:
    lines = []
    headline = r["allocations"][HEADLINE]
    ideal = r["allocations"]["ideal"]
    everyone = r["allocations"]["paged_all_layers"]
    if any(g["window"] is not None for g in r["layer_groups"]):
        lines.append(f"  windowed layers hold at most their window; ideal (exact tokens, no blocks): "
                     f"{_bytes(ideal['per_sequence_bytes'])} per sequence, max concurrency "
                     f"{ideal['max_concurrency']:,}")
    if everyone != headline:
        limit = everyone["max_context_by_memory"]
        lines.append(f"  a pool with one block table for all layers keeps out-of-window blocks (this server's "
                     f"with --window-kv-share 0): {_bytes(everyone['per_sequence_bytes'])} per sequence, max concurrency "
                     f"{everyone['max_concurrency']:,}, max context by memory "
                     f"{'unbounded' if limit is None else f'{limit:,} tokens'}")
    return lines


def _scales_text(dtype: KVDType) -> str:
    if dtype.scale_per == "token":
        return f"one fp32 scale ({SCALE_BYTES} B) per layer, K or V, token and KV head"
    if dtype.scale_per == "block":
        return f"one fp32 scale ({SCALE_BYTES} B) per layer, K or V, block and KV head"
    return "no scales"


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(float(value), 4)


def _plain(n: float) -> str:
    return f"{int(n):,} B" if float(n).is_integer() else f"{n:,.2f} B"


def _bytes(n: float) -> str:
    """'737,280 B (720 KiB)': exact bytes, then a binary unit for reading."""
    exact = _plain(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            scaled = n / size
            return f"{exact} ({scaled:,.{0 if scaled.is_integer() else 2}f} {unit})"
    return exact


def run(args) -> int:
    """The subcommand: args from reuse_server.server.cli (model, kv_dtype, device, block_size, context, concurrency,
    memory, json). Raises ModelLoadError/ValueError for the CLI to report."""
    from reuse_server.kv.kv_geometry import read_model_kv

    model = read_model_kv(args.model)
    dtype = kv_layout.kv_dtype(args.kv_dtype, args.device)
    context = args.context or model.max_context or 4096
    result = calculate(model, dtype, args.block_size, context, args.concurrency, args.memory)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0

