// A decode step's decoder layers in one call: the per-op path (llama.py) makes a dozen ctypes calls and torch
// ops per layer, and at a few rows the Python between them costs as much as the kernels. This runs the very
// kernels that path calls (cpu_kernels.h), in its order, on the same values, so the hidden states, the pool's
// K/V and the logits are that path's bit for bit; fused_decode.py decides which steps it takes.
//
// Per layer: input RMSNorm, the packed q/k/v product, the q/k norms where the model has them (Qwen3), RoPE on
// q and k, the K/V store into the pool at the step's slots, paged attention over the block tables, o_proj, the
// residual; post-attention RMSNorm, the packed gate/up product, SiLU gating, the down product, the residual.
// Each kernel shares its own work over the threads (cpu_tasks.h) as it does when called alone; the glue between
// them is a few KiB a step.
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace {

// The structures below mirror the ctypes ones in fused_decode.py, field for field.

constexpr int NO_TABLE = -2, BAD_SLOT = -3;  // kv_decode_layers' refusals (fused_decode.py's)
constexpr int64_t FP32_PANELS = -1;  // Linear::format of fp32 panels (kv_linear_f32); else kv_quant_linear_f32's
enum PoolFormat : int64_t { POOL_FP32 = 0, POOL_FP8 = 3, POOL_INT8 = 4 };  // cpu_attention.py's FORMATS

// One packed product's weights, as NativeLinear / NativeQuantLinear pass them to their kernel.
struct Linear {
    int64_t format;
    const void* weights;  // fp32 panels, or codes
    const void* scales;
    const void* mins;
    int64_t half_scales, group;
    const float* bias;
    int64_t in_features, out_features;
};

struct Layer {
    const float* input_norm;
    const float* post_norm;
    Linear qkv, o, gate_up, down;
    int64_t window;  // 0: the whole context
    const float* q_norm;  // Qwen3's RMSNorms over each query and key head before RoPE; null: none
    const float* k_norm;
};

// The model's shapes and weights, and one step's scratch (each buffer sized for the most rows a step takes).
struct Decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const Layer* layers;
    const float* final_norm;
    // RoPE's cos and sin of positions 0 .. table_positions - 1, [position][head_dim] (RotaryEmbedding.table):
    // the rows of the step's positions are copied out of them, the values torch computes for those positions.
    const float* cos_table;
    const float* sin_table;
    int64_t table_positions;
    float* cos;      // [rows][head_dim]
    float* sin;
    float* normed;   // [rows][hidden]
    float* qkv;      // [rows][(heads + 2 kv_heads) head_dim]
    float* qk;       // [rows][(heads + kv_heads) head_dim], rotated
    float* kv;       // [2][rows][kv_heads head_dim]: an 8-bit pool's store takes K and V as planes
    float* attn;     // [rows][heads head_dim]
    float* proj;     // [rows][hidden]: o_proj's and the down product's output
    float* gate_up;  // [rows][2 intermediate]
    float* act;      // [rows][intermediate]
};

// The pool's storage (KVPool.kernel_storage): layer l's K at data + l * layer_bytes, its V plane_bytes further;
// their scales likewise, in floats.
struct Pool {
    uint8_t* data;
    float* scales;
    int64_t format, layer_bytes, plane_bytes, scale_layer, scale_plane, block_size, num_slots;
};

// What changes every step: one query token per sequence, the attention kernel's plan (cpu_attention.KernelPlan).
struct Step {
    int64_t rows;
    const int64_t* slots;
    int64_t num_seqs;
    const int64_t* seq_info;
    const int64_t* block_tables;
    const int64_t* positions;
};

int linear(const Linear& w, const float* x, int64_t rows, float* y, int64_t threads) {
    if (w.format == FP32_PANELS) {
        kv_linear_f32(x, rows, w.in_features, w.in_features, static_cast<const float*>(w.weights), w.bias,
                      w.out_features, y, threads);
        return 0;
    }
    return kv_quant_linear_f32(x, rows, w.in_features, w.in_features, w.format,
                               static_cast<const uint8_t*>(w.weights), w.scales, w.mins, w.half_scales, w.group,
                               w.bias, w.out_features, y, threads);
}

// hidden = hidden + delta, the residual as torch adds it (one rounding per element).
void add_residual(float* hidden, const float* delta, int64_t n) {
    for (int64_t i = 0; i < n; ++i) hidden[i] += delta[i];
}

// The step's fresh K (each token's qk row, after its query heads) and V (its qkv row, after q and k) into the
// layer's planes, as KVPool.write stores them: copied into fp32, quantized by the pool's store kernels else.
int store_kv(const Decoder& d, const Pool& pool, int64_t layer, const Step& step, int64_t threads) {
    const int64_t rows = step.rows, width = d.kv_heads * d.head_dim;
    const int64_t qk_stride = (d.heads + d.kv_heads) * d.head_dim, qkv_stride = qk_stride + width;
    const float* k = d.qk + d.heads * d.head_dim;
    const float* v = d.qkv + qk_stride;
    uint8_t* planes = pool.data + layer * pool.layer_bytes;
    if (pool.format == POOL_FP32) {
        for (int64_t t = 0; t < rows; ++t) {
            const int64_t at = step.slots[t] * width * (int64_t)sizeof(float);
            std::memcpy(planes + at, k + t * qk_stride, width * sizeof(float));
            std::memcpy(planes + pool.plane_bytes + at, v + t * qkv_stride, width * sizeof(float));
        }
        return 0;
    }
    for (int64_t t = 0; t < rows; ++t) {
        std::memcpy(d.kv + t * width, k + t * qk_stride, width * sizeof(float));
        std::memcpy(d.kv + (rows + t) * width, v + t * qkv_stride, width * sizeof(float));
    }
    float* scales = pool.scales + layer * pool.scale_layer;
    if (pool.format == POOL_FP8) {
        kv_store_fp8(planes, scales, 2, pool.plane_bytes, pool.scale_plane, pool.block_size, d.kv_heads,
                     d.head_dim, step.slots, rows, d.kv, threads);
        return 0;
    }
    if (pool.format == POOL_INT8) {
        kv_store_int8(reinterpret_cast<int8_t*>(planes), scales, 2, pool.plane_bytes, pool.scale_plane, d.kv_heads,
                      d.head_dim, step.slots, rows, d.kv, threads);
        return 0;
    }
    return -1;
}

int attend(const Decoder& d, const Pool& pool, int64_t layer, const Step& step, int64_t threads) {
    const uint8_t* k = pool.data + layer * pool.layer_bytes;
    const uint8_t* v = k + pool.plane_bytes;
    const int64_t q_stride = (d.heads + d.kv_heads) * d.head_dim, window = d.layers[layer].window;
    if (pool.format == POOL_FP32)
        return kv_paged_attention_f32(d.qk, q_stride, d.attn, reinterpret_cast<const float*>(k),
                                      reinterpret_cast<const float*>(v), step.num_seqs, step.seq_info,
                                      step.block_tables, step.positions, d.heads, d.kv_heads, d.head_dim,
                                      pool.block_size, window, d.scale, threads);
    const float* k_scales = pool.scales + layer * pool.scale_layer;
    return kv_paged_attention(d.qk, q_stride, d.attn, k, v, k_scales, k_scales + pool.scale_plane, pool.format,
                              step.num_seqs, step.seq_info, step.block_tables, step.positions, d.heads,
                              d.kv_heads, d.head_dim, pool.block_size, window, d.scale, threads);
}

int attention_block(const Decoder& d, const Pool& pool, int64_t layer, const Step& step, float* hidden,
                    int64_t threads) {
    const Layer& w = d.layers[layer];
    const int64_t rows = step.rows;
    kv_rms_norm_f32(hidden, rows, d.hidden, d.hidden, w.input_norm, d.eps, d.normed, threads);
    if (linear(w.qkv, d.normed, rows, d.qkv, threads)) return -1;
    const int64_t qkv_stride = (d.heads + 2 * d.kv_heads) * d.head_dim;
    if (w.q_norm != nullptr) {  // in place, a head a row: each row's sum of squares is taken before it is written
        for (int64_t t = 0; t < rows; ++t) {
            float* q = d.qkv + t * qkv_stride;
            float* k = q + d.heads * d.head_dim;
            kv_rms_norm_f32(q, d.heads, d.head_dim, d.head_dim, w.q_norm, d.eps, q, threads);
            kv_rms_norm_f32(k, d.kv_heads, d.head_dim, d.head_dim, w.k_norm, d.eps, k, threads);
        }
    }
    if (kv_rope_f32(d.qkv, rows, d.heads + d.kv_heads, d.head_dim, qkv_stride, d.cos, d.sin, d.qk)) return -1;
    if (store_kv(d, pool, layer, step, threads)) return -1;  // before attending: each token sees its own K/V
    if (attend(d, pool, layer, step, threads)) return -1;
    if (linear(w.o, d.attn, rows, d.proj, threads)) return -1;
    add_residual(hidden, d.proj, rows * d.hidden);
    return 0;
}

int mlp_block(const Decoder& d, int64_t layer, int64_t rows, float* hidden, int64_t threads) {
    const Layer& w = d.layers[layer];
    kv_rms_norm_f32(hidden, rows, d.hidden, d.hidden, w.post_norm, d.eps, d.normed, threads);
    if (linear(w.gate_up, d.normed, rows, d.gate_up, threads)) return -1;
    kv_silu_mul_f32(d.gate_up, rows, d.intermediate, d.act, threads);
    if (linear(w.down, d.act, rows, d.proj, threads)) return -1;
    add_residual(hidden, d.proj, rows * d.hidden);
    return 0;
}

}  // namespace

// hidden: [rows][hidden] fp32, the embedded tokens, replaced by the last layer's output after the final norm.
// Returns 0; NO_TABLE, having done nothing, for a position beyond the cos/sin table; BAD_SLOT, having done
// nothing, for a slot outside the pool; or 1 + the layer whose kernel did not take its arguments (the layers
// before it ran).
extern "C" int kv_decode_layers(float* hidden, const Decoder* decoder, const Pool* pool, const Step* step,
                                int64_t num_threads) {
    const Decoder& d = *decoder;
    const int64_t rows = step->rows;
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t p = step->positions[t], slot = step->slots[t];
        if (p < 0 || p >= d.table_positions) return NO_TABLE;
        if (slot < 0 || slot >= pool->num_slots) return BAD_SLOT;
        std::memcpy(d.cos + t * d.head_dim, d.cos_table + p * d.head_dim, d.head_dim * sizeof(float));
        std::memcpy(d.sin + t * d.head_dim, d.sin_table + p * d.head_dim, d.head_dim * sizeof(float));
    }
    for (int64_t layer = 0; layer < d.num_layers; ++layer) {
        if (attention_block(d, *pool, layer, *step, hidden, num_threads) ||
            mlp_block(d, layer, rows, hidden, num_threads))
            return (int)(1 + layer);
    }
    // In place: each row's sum of squares is taken before any of its values is written.
    kv_rms_norm_f32(hidden, rows, d.hidden, d.hidden, d.final_norm, d.eps, hidden, num_threads);
    return 0;
}
