// Element-wise layers of a Llama step on the CPU, fp32, each one pass over its rows: RMSNorm and the MLP's
// SiLU gating. torch runs RMSNorm as six ops (F.rms_norm decomposes it) and SiLU-and-multiply as two, each
// with its own dispatch and thread hand-off: ~50 us a call for a warm request's 17 rows, 3 ms of a step.
#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

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

// out[r, :] = silu(gate_up[r, :n]) * gate_up[r, n:2n]  (the gate and up projections side by side)
extern "C" void kv_silu_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out, int64_t num_threads) {
    const int threads = rows * n < SERIAL_ELEMENTS ? 1 : (int)num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
        const float* g = gate_up + r * 2 * n;
        const float* u = g + n;
        float* y = out + r * n;
        int64_t c = 0;
        for (; c + LANES <= n; c += LANES) {
            const v16 gv = load(g + c);
            store(y + c, gv / (splat(1.0f) + vexp(-gv)) * load(u + c));
        }
        for (; c < n; ++c) y[c] = g[c] / (1.0f + std::exp(-g[c])) * u[c];
    }
}
