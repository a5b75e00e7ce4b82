// Quantizing writes into the KV pool's 8-bit formats (kv_pool.py, kv_quant.py), on the CPU: the same
// arithmetic as the pool's torch path, bit for bit, without its dozens of small tensor operations per write
// (a decode step writes one token per sequence into every layer).
//
// A "plane" is one layer's K or V: data [blocks][block_size][heads][dim], scales per plane as below.
// - fp8 e4m3fn: one scale per (block, head), a power of two. A block takes the scale that its kept tokens
//   (those not written now) and its new ones need together; kept tokens are re-expressed when it changes.
// - int8: one scale per (slot, head) = amax / 127, stored = round(x / scale).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_tasks.h"

namespace {

constexpr float FP8_MAX = 448.f;

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

// The smallest power of two s with amax <= 448 * s (0 for 0), as kv_quant.fp8_scale computes it.
inline float fp8_scale(float amax) { return float_of((bits_of(amax / FP8_MAX) + 0x7FFFFFu) & 0x7F800000u); }

// float -> e4m3fn, saturated at +-448 and rounded to nearest even (torch's clamp, then its conversion).
inline uint8_t to_e4m3(float x) {
    const uint8_t sign = (uint8_t)((bits_of(x) >> 24) & 0x80);
    if (std::isnan(x)) return sign | 0x7F;
    const float a = std::fabs(x);
    if (a >= FP8_MAX) return sign | 0x7E;
    if (a < 0.015625f) return sign | (uint8_t)std::nearbyint(a * 512.f);  // below 2^-6: steps of 2^-9
    uint32_t u = bits_of(a);
    u += 0x7FFFFu + ((u >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
    return sign | (uint8_t)((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u));
}

// e4m3fn -> float (0x7F, NaN, is never stored: writes saturate)
inline float from_e4m3(uint8_t b) {
    const int exponent = (b >> 3) & 0xF, mantissa = b & 7;
    const float a = exponent ? std::ldexp(1.f + mantissa / 8.f, exponent - 7) : std::ldexp((float)mantissa, -9);
    return (b & 0x80) ? -a : a;
}

struct Fp8Table {
    float value[256];
    Fp8Table() { for (int b = 0; b < 256; ++b) value[b] = from_e4m3((uint8_t)b); }
};
const Fp8Table FP8_VALUES;

}  // namespace

// values: [planes][n][heads][dim] fp32, contiguous; slots: [n], distinct. data/scales: plane p's block b,
// offset o, head h at data + p * data_plane + ((b * block_size + o) * heads + h) * dim and
// scales + p * scale_plane + b * heads + h.
extern "C" void kv_store_fp8(uint8_t* data, float* scales, int64_t planes, int64_t data_plane, int64_t scale_plane,
                             int64_t block_size, int64_t heads, int64_t dim, const int64_t* slots, int64_t n,
                             const float* values, int64_t num_threads) {
    // the tokens of each block written, grouped: order[first[g] .. first[g + 1]) are block blocks[g]'s
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
    std::vector<int64_t> blocks, first;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t block = slots[order[i]] / block_size;
        if (blocks.empty() || blocks.back() != block) { blocks.push_back(block); first.push_back(i); }
    }
    first.push_back(n);
    const int64_t groups = (int64_t)blocks.size();
    const int64_t token = heads * dim;
#pragma omp parallel for collapse(2) schedule(static) num_threads((int)num_threads) if (groups * planes >= 16)
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t p = 0; p < planes; ++p) {
            uint8_t* block = data + p * data_plane + blocks[g] * block_size * token;
            std::vector<char> written(block_size, 0);
            for (int64_t i = first[g]; i < first[g + 1]; ++i) written[slots[order[i]] % block_size] = 1;
            for (int64_t h = 0; h < heads; ++h) {
                float* scale = scales + p * scale_plane + blocks[g] * heads + h;
                const float old = *scale;
                uint8_t kept_code = 0;  // e4m3 orders like its bits: the largest |value| has the largest code
                for (int64_t o = 0; o < block_size; ++o)
                    if (!written[o])
                        for (int64_t d = 0; d < dim; ++d) kept_code = std::max<uint8_t>(kept_code, block[(o * heads + h) * dim + d] & 0x7F);
                const float kept = FP8_VALUES.value[kept_code] * old;
                float fresh = 0.f;
                for (int64_t i = first[g]; i < first[g + 1]; ++i) {
                    const float* x = values + (p * n + order[i]) * token + h * dim;
                    for (int64_t d = 0; d < dim; ++d) fresh = std::max(fresh, std::fabs(x[d]));
                }
                const float s = fp8_scale(std::max(kept, fresh));
                const float divisor = s > 0.f ? s : 1.f;
                if (s != old && kept > 0.f)
                    for (int64_t o = 0; o < block_size; ++o)
                        if (!written[o])
                            for (int64_t d = 0; d < dim; ++d) {
                                uint8_t& b = block[(o * heads + h) * dim + d];
                                b = to_e4m3(FP8_VALUES.value[b] * old / divisor);
                            }
                for (int64_t i = first[g]; i < first[g + 1]; ++i) {
                    const float* x = values + (p * n + order[i]) * token + h * dim;
                    uint8_t* out = block + ((slots[order[i]] % block_size) * heads + h) * dim;
                    for (int64_t d = 0; d < dim; ++d) out[d] = to_e4m3(x[d] / divisor);
                }
                *scale = s;
            }
        }
    }
}

// int8: data/scales plane p's slot s, head h at data + p * data_plane + (s * heads + h) * dim and
// scales + p * scale_plane + s * heads + h.
extern "C" void kv_store_int8(int8_t* data, float* scales, int64_t planes, int64_t data_plane, int64_t scale_plane,
                              int64_t heads, int64_t dim, const int64_t* slots, int64_t n, const float* values,
                              int64_t num_threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads((int)num_threads) if (n * planes >= 64)
    for (int64_t p = 0; p < planes; ++p) {
        for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < heads; ++h) {
                const float* x = values + ((p * n + i) * heads + h) * dim;
                float amax = 0.f;
                for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(x[d]));
                const float s = amax / 127.f;
                const float divisor = s > 0.f ? s : 1.f;
                int8_t* out = data + p * data_plane + (slots[i] * heads + h) * dim;
                for (int64_t d = 0; d < dim; ++d)
                    out[d] = (int8_t)std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / divisor)));
                scales[p * scale_plane + slots[i] * heads + h] = s;
            }
        }
    }
}

// Whole blocks between the pool and block buffers (a tier's rows, an export's): buffer row r holds `pieces`
// runs of `piece` bytes (each layer's K, then its V), which in the pool lie at pool + p * plane + ids[r] *
// piece. A tier hit copies a few hundred MB this way; torch's indexed assignment computes every element's
// address instead of copying runs, and leaves the second core idle.
extern "C" void kv_copy_blocks(uint8_t* pool, int64_t plane, const int64_t* ids, uint8_t* const* rows, int64_t n,
                               int64_t pieces, int64_t piece, int64_t to_pool, int64_t threads) {
    auto copy = [&](int64_t r) {
        uint8_t* row = rows[r];
        uint8_t* block = pool + ids[r] * piece;
        for (int64_t p = 0; p < pieces; ++p) {
            if (to_pool)
                std::memcpy(block + p * plane, row + p * piece, piece);
            else
                std::memcpy(row + p * piece, block + p * plane, piece);
        }
    };
    kv::share_tasks(n, (int)threads, copy);
}
