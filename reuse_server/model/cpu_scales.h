// The group scales (and minimums) of the quantized products, cpu_quant.cpp's and cpu_quant_a8.cpp's: fp16 or
// fp32, 16 at a time into fp32 lanes, and the one dispatch that instantiates a kernel for each type and for
// with and without minimums.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "cpu_vector.h"

namespace kv {

// 16 fp16 to fp32 with the CPU's conversion instruction (gcc's vector conversion of _Float16 goes one lane at
// a time where the CPU lacks AVX512-FP16 arithmetic).
inline v16 widen_half(const _Float16* p) {
#if defined(__AVX512F__)
    const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    v16 out;
    std::memcpy(&out, &v, sizeof out);
    return out;
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    v16 out;
    std::memcpy(&out, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
    return out;
#else
    typedef _Float16 h16 __attribute__((vector_size(32)));
    h16 a;
    std::memcpy(&a, p, 32);
    return __builtin_convertvector(a, v16);
#endif
}

inline v16 load_scales(const float* p) { return load(p); }
inline v16 load_scales(const _Float16* p) { return widen_half(p); }

// body(S{}, std::bool_constant<MIN>{}): the scales' type S (fp16 where half_scales) and whether minimums come.
template <class Body>
inline void with_scales(int64_t half_scales, const void* mins, Body&& body) {
    if (half_scales) {
        if (mins) body(_Float16{}, std::true_type{});
        else body(_Float16{}, std::false_type{});
    } else {
        if (mins) body(float{}, std::true_type{});
        else body(float{}, std::false_type{});
    }
}

}  // namespace kv
