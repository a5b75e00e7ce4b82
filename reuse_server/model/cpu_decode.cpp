// A decode step's decoder layers in one call: the per-op path (llama.py) makes a dozen ctypes calls and torch
// ops per layer, and at a few rows the Python between them costs as much as the kernels. This runs the very
// kernels that path calls (cpu_kernels.h), in its order, on the same values, so the hidden states, the pool's
// K/V and the logits are that path's bit for bit; fused_decode.py decides which steps it takes.
//
// Per layer: input RMSNorm, the packed q/k/v product, the q/k norms where the model has them (Qwen3, Gemma 3),
// RoPE on q and k (with the layer's base: Gemma 3's sliding layers have one of their own), the K/V store into
// the layer's pool at the step's slots, paged attention over the block tables, o_proj, the residual;
// post-attention RMSNorm, the packed gate/up product, SiLU or GELU gating, the down product, the residual.
// Gemma's sandwich norms: the attention's and the MLP's outputs are normed before their residuals, and the MLP's
// input has a norm of its own. A hybrid model's layers live in two pools (LayeredKVPool: full attention and
// sliding window), each with the step's slots and block tables in its own block ids.
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
    const float* post_norm;  // Llama: the MLP's input norm; Gemma: the attention output's
    Linear qkv, o, gate_up, down;
    int64_t window;  // 0: the whole context
    const float* q_norm;  // the RMSNorms over each query and key head before RoPE (Qwen3, Gemma 3); null: none
    const float* k_norm;
    const float* pre_ff_norm;  // Gemma: the MLP's input norm and its output's; null: none (Llama's order)
    const float* post_ff_norm;
    int64_t rope;  // which RoPE table: 0, the model's; 1, its sliding layers' (Gemma 3)
};

// The model's shapes and weights, and one step's scratch (each buffer sized for the most rows a step takes).
struct Decoder {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    int64_t gelu;  // the MLP's gating: GELU (tanh) if set, else SiLU
    float eps, scale;
    const Layer* layers;
    const float* final_norm;
    // RoPE's cos and sin of positions 0 .. table_positions - 1, [position][head_dim] (RotaryEmbedding.table):
    // the rows of the step's positions are copied out of them, the values torch computes for those positions.
    // A second pair for Gemma 3's sliding layers (null: none).
    const float* cos_table;
    const float* sin_table;
    const float* local_cos_table;
    const float* local_sin_table;
    int64_t table_positions;
    float* cos;      // [2][rows][head_dim]: the step's rows of each table
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

// What changes every step, per pool: one query token per sequence (its slot in that pool's ids), the attention
// kernel's plan (cpu_attention.KernelPlan).
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

// A block's output (attention's or the MLP's, [rows][hidden]) into the residual stream, through its RMSNorm first
// where the model norms it (Gemma; null: not).
void add_output(const Decoder& d, float* hidden, const float* out, const float* norm, int64_t rows, int64_t threads) {
    if (norm != nullptr) {
        kv_rms_norm_f32(out, rows, d.hidden, d.hidden, norm, d.eps, d.normed, threads);
        out = d.normed;
    }
    add_residual(hidden, out, rows * d.hidden);
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

int attend(const Decoder& d, const Pool& pool, int64_t layer, int64_t window, const Step& step, int64_t threads) {
    const uint8_t* k = pool.data + layer * pool.layer_bytes;
    const uint8_t* v = k + pool.plane_bytes;
    const int64_t q_stride = (d.heads + d.kv_heads) * d.head_dim;
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

// Where each layer's K/V lives: routes[2 l] is the pool (0 or 1) and routes[2 l + 1] the layer's index there.
int attention_block(const Decoder& d, const Pool* pools, const Step* steps, const int64_t* routes, int64_t layer,
                    float* hidden, int64_t threads) {
    const Layer& w = d.layers[layer];
    const Pool& pool = pools[routes[2 * layer]];
    const Step& step = steps[routes[2 * layer]];
    const int64_t index = routes[2 * layer + 1], rows = step.rows;
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
    const int64_t table = w.rope * rows * d.head_dim;
    if (kv_rope_f32(d.qkv, rows, d.heads + d.kv_heads, d.head_dim, qkv_stride, d.cos + table, d.sin + table, d.qk))
        return -1;
    if (store_kv(d, pool, index, step, threads)) return -1;  // before attending: each token sees its own K/V
    if (attend(d, pool, index, w.window, step, threads)) return -1;
    if (linear(w.o, d.attn, rows, d.proj, threads)) return -1;
    add_output(d, hidden, d.proj, w.pre_ff_norm != nullptr ? w.post_norm : nullptr, rows, threads);
    return 0;
}

int mlp_block(const Decoder& d, int64_t layer, int64_t rows, float* hidden, int64_t threads) {
    const Layer& w = d.layers[layer];
    const float* input_norm = w.pre_ff_norm != nullptr ? w.pre_ff_norm : w.post_norm;  // Gemma's, else Llama's
    kv_rms_norm_f32(hidden, rows, d.hidden, d.hidden, input_norm, d.eps, d.normed, threads);
    if (linear(w.gate_up, d.normed, rows, d.gate_up, threads)) return -1;
    if (d.gelu) kv_gelu_mul_f32(d.gate_up, rows, d.intermediate, d.act, threads);
    else kv_silu_mul_f32(d.gate_up, rows, d.intermediate, d.act, threads);
    if (linear(w.down, d.act, rows, d.proj, threads)) return -1;
    add_output(d, hidden, d.proj, w.post_ff_norm, rows, threads);
    return 0;
}

}  // namespace

// hidden: [rows][hidden] fp32, the embedded tokens, replaced by the last layer's output after the final norm.
// pools, steps: num_pools (1 or 2) of each, the step's rows the same in each; routes: as attention_block reads
// them. Returns 0; NO_TABLE, having done nothing, for a position beyond the cos/sin table; BAD_SLOT, having done
// nothing, for a slot outside its pool; or 1 + the layer whose kernel did not take its arguments (the layers
// before it ran).
extern "C" int kv_decode_layers(float* hidden, const Decoder* decoder, const Pool* pools, const Step* steps,
                                int64_t num_pools, const int64_t* routes, int64_t num_threads) {
    const Decoder& d = *decoder;
    const int64_t rows = steps[0].rows;
    for (int64_t p = 0; p < num_pools; ++p)
        for (int64_t t = 0; t < rows; ++t)
            if (steps[p].slots[t] < 0 || steps[p].slots[t] >= pools[p].num_slots) return BAD_SLOT;
    const int64_t tables = d.local_cos_table != nullptr ? 2 : 1;
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t p = steps[0].positions[t];
        if (p < 0 || p >= d.table_positions) return NO_TABLE;
        for (int64_t table = 0; table < tables; ++table) {
            const int64_t at = (table * rows + t) * d.head_dim;
            std::memcpy(d.cos + at, (table ? d.local_cos_table : d.cos_table) + p * d.head_dim,
                        d.head_dim * sizeof(float));
            std::memcpy(d.sin + at, (table ? d.local_sin_table : d.sin_table) + p * d.head_dim,
                        d.head_dim * sizeof(float));
        }
    }
    for (int64_t layer = 0; layer < d.num_layers; ++layer) {
        if (attention_block(d, pools, steps, routes, layer, hidden, num_threads) ||
            mlp_block(d, layer, rows, hidden, num_threads))
            return (int)(1 + layer);
    }
    // In place: each row's sum of squares is taken before any of its values is written.
    kv_rms_norm_f32(hidden, rows, d.hidden, d.hidden, d.final_norm, d.eps, hidden, num_threads);
    return 0;
}
