// Element-wise layers of a Llama step on the CPU, fp32, each one pass over its rows: RMSNorm and the MLP's
// SiLU or GELU gating (and RoPE, at the end). torch runs RMSNorm as six ops (F.rms_norm decomposes it) and
// SiLU-and-multiply as two, each with its own dispatch and thread hand-off: ~50 us a call for a warm request's
// 17 rows, 3 ms of a step.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_vector.h"

namespace {

using namespace kv;

// Below this many elements a call stays on the calling thread.
constexpr int64_t SERIAL_ELEMENTS = 1 << 16;

}  // namespace

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, as transformers' LlamaRMSNorm computes it in fp32.
extern "C" void kv_rms_norm_f32(const float* x, int64_t rows, int64_t cols, int64_t ldx, const float* weight,
                                float eps, float* out, int64_t num_threads) {
    const int threads = rows * cols < SERIAL_ELEMENTS ? 1 : (int)num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        float* yr = out + r * cols;
        int64_t c = 0;
        v16 acc = v16{};
        for (; c + 16 <= cols; c += 16) {
            const v16 v = load(xr + c);
            acc += v * v;
        }
        float sum = 0.f;
        for (int i = 0; i < 16; ++i) sum += acc[i];
        for (; c < cols; ++c) sum += xr[c] * xr[c];
        const float inv = 1.0f / std::sqrt(sum / (float)cols + eps);
        c = 0;
        for (; c + 16 <= cols; c += 16) store(yr + c, load(xr + c) * splat(inv) * load(weight + c));
        for (; c < cols; ++c) yr[c] = xr[c] * inv * weight[c];
    }
}

// out[r, :] = act(gate_up[r, :n]) * gate_up[r, n:2n] (the gate and up projections side by side), where act is
// x / (1 + exp(-s(x))): SiLU with s(x) = x; GELU's tanh approximation (Gemma's GeGLU, torch's
// F.gelu(approximate="tanh"): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3)) with s(x) = 2u, the same
// function without tanh's cancellation near u = 0. GELU is not torch's rounding (within ~1e-6 of it); the
// model's per-op path and the fused decode both call this.
namespace {

template <bool GELU>
void gated(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads) {
    constexpr float TWO_BETA = 1.5957691216057308f;  // 2 sqrt(2 / pi)
    constexpr float KAPPA = 0.044715f;
    const int threads = rows * n < SERIAL_ELEMENTS ? 1 : (int)num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * n;
        const float* u = g + n;
        float* y = out + r * n;
        int64_t c = 0;
        for (; c + LANES <= n; c += LANES) {
            const v16 x = load(g + c);
            v16 s = x;
            if constexpr (GELU) s = splat(TWO_BETA) * (x + splat(KAPPA) * (x * x * x));
            store(y + c, x / (splat(1.0f) + vexp(-s)) * load(u + c));
        }
        for (; c < n; ++c) {
            const float x = g[c];
            const float s = GELU ? TWO_BETA * (x + KAPPA * (x * x * x)) : x;
            y[c] = x / (1.0f + std::exp(-s)) * u[c];
        }
    }
}

}  // namespace

extern "C" void kv_silu_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads) {
    gated<false>(gate_up, rows, n, out, num_threads);
}

extern "C" void kv_gelu_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads) {
    gated<true>(gate_up, rows, n, out, num_threads);
}

// RoPE in transformers' "neox" layout (rope.apply_rotary): out = x * cos + rotate_half(x) * sin, per token over
// its heads, x: [tokens][heads][head_dim] with token stride ldx, cos/sin: [tokens][head_dim], out contiguous.
// torch rounds the two products and their sum one by one; the *_round intrinsics are never fused into an FMA
// by the compiler, so the result is torch's bit for bit. Returns -1 (the caller then uses torch) without
// AVX-512 or for a head_dim that is not a multiple of 32.
extern "C" int kv_rope_f32(const float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t ldx,
                           const float* cos, const float* sin, float* out) {
#if defined(__AVX512F__)
    const int64_t half = head_dim / 2;
    if (head_dim % 32) return -1;
    constexpr int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t t = 0; t < tokens; ++t) {
        const float* c = cos + t * head_dim;
        const float* s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float* xh = x + t * ldx + h * head_dim;
            float* oh = out + (t * heads + h) * head_dim;
            for (int64_t d = 0; d < half; d += 16) {
                const __m512 x1 = _mm512_loadu_ps(xh + d), x2 = _mm512_loadu_ps(xh + half + d);
                const __m512 neg_x2 = _mm512_castsi512_ps(
                    _mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
                // first half: x1 * cos - x2 * sin (as torch: x1 * cos + (-x2) * sin); second: x2 * cos + x1 * sin
                _mm512_storeu_ps(oh + d, _mm512_add_round_ps(_mm512_mul_round_ps(x1, _mm512_loadu_ps(c + d), R),
                                                             _mm512_mul_round_ps(neg_x2, _mm512_loadu_ps(s + d), R), R));
                _mm512_storeu_ps(oh + half + d,
                                 _mm512_add_round_ps(_mm512_mul_round_ps(x2, _mm512_loadu_ps(c + half + d), R),
                                                     _mm512_mul_round_ps(x1, _mm512_loadu_ps(s + half + d), R), R));
            }
        }
    }
    return 0;
#else
    (void)x; (void)tokens; (void)heads; (void)head_dim; (void)ldx; (void)cos; (void)sin; (void)out;
    return -1;
#endif
}

// out[r] = the index of row r's largest value, as torch.argmax picks it: the first of equal ones, and a NaN
// counts as larger than any number (the first NaN wins). One pass for the largest value, one for its index:
// torch's reduction does the 49,152 logits of a row one by one (~45 us a row; this is a few).
extern "C" void kv_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t ldx, int64_t* out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * ldx;
        v16 best = splat(-INFINITY);
        vi16 nan = vi16{};
        int64_t c = 0;
        for (; c + LANES <= cols; c += LANES) {
            const v16 v = load(xr + c);
            nan |= (v != v);
            best = vmax(best, v);
        }
        float top = -INFINITY;
        bool any_nan = false;
        for (int i = 0; i < LANES; ++i) {
            top = best[i] > top ? best[i] : top;
            any_nan |= nan[i] != 0;
        }
        for (; c < cols; ++c) {
            any_nan |= xr[c] != xr[c];
            top = xr[c] > top ? xr[c] : top;
        }
        int64_t at = 0;
        if (any_nan) {
            while (xr[at] == xr[at]) ++at;
        } else {
            while (at < cols - 1 && xr[at] != top) ++at;
        }
        out[r] = at;
    }
}
