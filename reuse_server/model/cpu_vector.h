// 16-lane fp32 vectors for the CPU kernels: gcc's vector extensions, which -march=native turns into
// AVX-512 (one register), AVX2 (two) or SSE (four) code.
#pragma once

#include <cstdint>
#include <cstring>

namespace kv {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

constexpr int LANES = 16;

inline v16 load(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
// x in every lane, as one broadcast (which an FMA can take as its memory operand). Not `v16{} + x`: that is an
// addition to zero, which the compiler must keep (it turns -0 into +0), one more instruction a lane-wise use.
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
inline v16 vmin(v16 a, v16 b) { return a < b ? a : b; }

// exp(x), relative error ~2e-7 (Cephes' expf polynomial); arguments below -87 give ~1e-38, not 0.
inline v16 vexp(v16 x) {
    x = vmin(vmax(x, splat(-87.0f)), splat(88.0f));
    const v16 round = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
    v16 n = (x * splat(1.44269504088896341f) + round) - round;
    v16 r = x - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
    return p * (v16)e;
}

// acc[i][h] += x[i * ldx + kk] * panel[kk * 64 + 16 * h ...] for kk = 0 .. k - 1, in that order: the inner loop
// of the fp32 linear kernel over one panel of 64 output columns stored k-major (cpu_linear.cpp), which the
// quantized kernel runs over its decoded chunks too (cpu_quant.cpp). One loop for both keeps the order of a
// row's sums the same in both, which keeps their results equal.
template <int RT>
inline void panel_fma(v16 (&acc)[RT][4], const float* x, int64_t ldx, const float* panel, int64_t k) {
    for (int64_t kk = 0; kk < k; ++kk) {
        const float* w = panel + kk * 64;
        const v16 w0 = load(w), w1 = load(w + 16), w2 = load(w + 32), w3 = load(w + 48);
        for (int i = 0; i < RT; ++i) {
            const v16 xb = splat(x[i * ldx + kk]);
            acc[i][0] += xb * w0;
            acc[i][1] += xb * w1;
            acc[i][2] += xb * w2;
            acc[i][3] += xb * w3;
        }
    }
}

}  // namespace kv
