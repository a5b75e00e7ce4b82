// The kernels' C entry points (native.py's SIGNATURES lists them for ctypes), declared once: the sources that
// define them include this, so a definition that drifts from its declaration does not compile, and
// cpu_decode.cpp calls them as they are to run a decode step's layers in one call.
#pragma once

#include <cstdint>

extern "C" {

void kv_rms_norm_f32(const float* x, int64_t rows, int64_t cols, int64_t ldx, const float* weight, float eps,
                     float* out, int64_t num_threads);
void kv_silu_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads);
void kv_gelu_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads);
int kv_rope_f32(const float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldx, const float* cos,
                const float* sin, float* out);
void kv_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t ldx, int64_t* out);

void kv_linear_f32(const float* x, int64_t m, int64_t ldx, int64_t k, const float* panels, const float* bias,
                   int64_t n, float* y, int64_t num_threads);
int kv_quant_linear_f32(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t format, const uint8_t* panels,
                        const void* scales, const void* mins, int64_t half_scales, int64_t group,
                        const float* bias, int64_t n, float* y, int64_t num_threads);
int kv_quant_linear_a8(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t int8, const uint8_t* panels,
                       const void* scales, const void* mins, int64_t half_scales, int64_t group, const float* bias,
                       int64_t n, float* y, int64_t num_threads);

int kv_paged_attention_f32(const float* q, int64_t q_token_stride, float* out, const float* k_pool,
                           const float* v_pool, int64_t num_seqs, const int64_t* seq_info,
                           const int64_t* block_tables, const int64_t* positions, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, float scale, int64_t num_threads);
int kv_paged_attention(const float* q, int64_t q_token_stride, float* out, const void* k_pool, const void* v_pool,
                       const float* k_scales, const float* v_scales, int64_t format, int64_t num_seqs,
                       const int64_t* seq_info, const int64_t* block_tables, const int64_t* positions,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                       float scale, int64_t num_threads);

void kv_store_fp8(uint8_t* data, float* scales, int64_t planes, int64_t data_plane, int64_t scale_plane,
                  int64_t block_size, int64_t heads, int64_t dim, const int64_t* slots, int64_t n,
                  const float* values, int64_t num_threads);
void kv_store_int8(int8_t* data, float* scales, int64_t planes, int64_t data_plane, int64_t scale_plane,
                   int64_t heads, int64_t dim, const int64_t* slots, int64_t n, const float* values,
                   int64_t num_threads);

}  // extern "C"
