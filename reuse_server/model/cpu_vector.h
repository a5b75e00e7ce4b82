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
inline v16 splat(float x) { return v16{} + x; }
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

}  // namespace kv
