// y = x W^T + b on the CPU with W held in fewer bits than fp32: bf16, or int8/int4 codes q with a scale s (and
// optionally a minimum m) per group of `group` consecutive inputs of an output, w = s * q + m. x and y stay fp32.
//
// Decode reads every weight once per step, so its time is the weights' bytes; the codes are widened to fp32 in
// registers (w = s * q + m, the very values gguf's dequantization gives for Q4_0/Q4_1/Q8_0 and the K-quants)
// and multiplied with fp32 activations, so the only difference from the fp32 kernel is the order of the sums.
//
// Layout, as cpu_linear.cpp: panels of 64 output columns, each [K][64] (k-major), zero-padded past the last
// column. Per k a panel holds 64 codes: int8 64 bytes; int4 32 bytes, byte j = column j (low nibble) | column
// j + 32 (high nibble); bf16 128 bytes. Scales and minimums: [panels][groups][64], fp32 or fp16.
//
// A few rows (decode) run straight from the codes: each panel row is widened once and used by every row of x;
// their panels are shared between the calling thread and helpers that are running (cpu_tasks.h), not handed
// to an OpenMP team whose barrier waits for a helper the busy CPU has not scheduled.
// More rows decode a chunk of the panel into an fp32 buffer that stays in L1 and run the fp32 tile over it,
// so the widening is paid once per chunk of rows rather than once per row tile. Both paths add the products
// of a row in the same order (bias, then k = 0, 1, ...), from the same fp32 weights: a row's result does not
// depend on which rows share its step, which keeps prefix reuse exact (the cached rows were computed in
// another step than the ones reusing them).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_scales.h"
#include "cpu_tasks.h"
#include "cpu_vector.h"

namespace {

using namespace kv;

constexpr int PANEL = 64;
static_assert(PANEL == 64, "panel_fma (cpu_vector.h) runs panels of 64 columns");
// Up to DIRECT_ROWS rows of x run straight from the codes, in tiles of DIRECT_TILE rows that each widen a
// panel's codes once; more rows decode chunks of CHUNK k (128 KiB of fp32, in L2) shared by blocks of up to
// BLOCK_ROWS rows, whose accumulators (96 KiB) stay in L2 too. Measured on SmolLM2's layer shapes against each
// other and against the fp32 kernel (cpu_linear.cpp): the direct tiles cost what fp32 costs up to 24 rows,
// the blocks within a few percent of it at 30 to 512 rows.
constexpr int DIRECT_ROWS = 24;
constexpr int DIRECT_TILE = 6;  // also a task's rows: each tile widens its panel itself
constexpr int TILE_ROWS = 6;    // rows of the fp32 tile in the buffered path
constexpr int BLOCK_ROWS = 384;
constexpr int MIN_BLOCK_ROWS = DIRECT_ROWS;
constexpr int CHUNK = 512;
constexpr int64_t PREFETCH_BYTES = 2048;  // how far ahead the direct path asks for its codes
constexpr int64_t SCALES_AHEAD = 2;       // and for its groups' scales and minimums
constexpr int TASKS_PER_THREAD = 2;       // the direct path's tasks per thread

typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// INT8_A8 and INT4_A8: the same codes with int8 activations, in cpu_quant_a8.cpp's layout.
enum Format : int64_t { BF16 = 0, INT8 = 1, INT4 = 2, INT8_A8 = 3, INT4_A8 = 4 };

// 16 bytes (unsigned or signed) or 16 bf16 to 16 fp32 lanes. gcc's vector conversions widen 8-bit lanes one at
// a time, so AVX-512 gets the widening instructions by name.
inline v16 as_v16(const vi16& i) { return __builtin_convertvector(i, v16); }

#if !defined(__AVX512F__) && defined(__AVX2__)
inline v16 join(__m256i lo, __m256i hi) {
    vi16 i;
    std::memcpy(&i, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&i) + 32, &hi, 32);
    return as_v16(i);
}
#endif

inline v16 widen(u8x16 a) {
#if defined(__AVX512F__)
    __m128i b;
    std::memcpy(&b, &a, 16);
    const __m512i w = _mm512_cvtepu8_epi32(b);
    vi16 i;
    std::memcpy(&i, &w, 64);
    return as_v16(i);
#elif defined(__AVX2__)
    __m128i b;
    std::memcpy(&b, &a, 16);
    return join(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
#else
    return as_v16(__builtin_convertvector(__builtin_convertvector(a, u32x16), vi16));
#endif
}

inline v16 widen(i8x16 a) {
#if defined(__AVX512F__)
    __m128i b;
    std::memcpy(&b, &a, 16);
    const __m512i w = _mm512_cvtepi8_epi32(b);
    vi16 i;
    std::memcpy(&i, &w, 64);
    return as_v16(i);
#elif defined(__AVX2__)
    __m128i b;
    std::memcpy(&b, &a, 16);
    return join(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
#else
    return as_v16(__builtin_convertvector(a, vi16));
#endif
}

inline v16 widen_bf16(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    v16 out;
    std::memcpy(&out, &w, 64);
    return out;
#elif defined(__AVX2__)
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16);
    const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16);
    v16 out;
    std::memcpy(&out, &lo, 32);
    std::memcpy(reinterpret_cast<char*>(&out) + 32, &hi, 32);
    return out;
#else
    u16x16 a;
    std::memcpy(&a, p, 32);
    return (v16)(__builtin_convertvector(a, u32x16) << 16);  // bf16 is the top half of an fp32
#endif
}

struct Int4 {
    static constexpr int BYTES = 32;
    static constexpr bool SCALED = true;
    static inline void decode(const uint8_t* p, v16 q[4]) {
#if defined(__AVX512F__)
        // Each byte widened to a 32-bit lane (column j's code in bits 0-3, column j + 32's in bits 4-7), then
        // each code made fp32 by a lookup in a table of 0.0 .. 15.0 (vpermps reads only an index's low 4 bits,
        // so the low nibble needs no mask and the high one one shift): fewer operations than masking the
        // nibbles in bytes and converting, and the very values conversion gives (the model's 120 one-row int4
        // products on one thread: 8.9 -> 8.1 ms, BENCHMARKS.md "Decode: where a step's time goes").
        const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
        const __m512 w[4] = {_mm512_permutexvar_ps(a, table), _mm512_permutexvar_ps(b, table),
                             _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), table),
                             _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table)};
        std::memcpy(q, w, sizeof w);
#else
        u8x16 a, b;
        std::memcpy(&a, p, 16);
        std::memcpy(&b, p + 16, 16);
        q[0] = widen(a & 15);
        q[1] = widen(b & 15);
        q[2] = widen(a >> 4);
        q[3] = widen(b >> 4);
#endif
    }
};

struct Int8 {
    static constexpr int BYTES = 64;
    static constexpr bool SCALED = true;
    static inline void decode(const uint8_t* p, v16 q[4]) {
        for (int h = 0; h < 4; ++h) {
            i8x16 a;
            std::memcpy(&a, p + 16 * h, 16);
            q[h] = widen(a);
        }
    }
};

struct Bf16 {
    static constexpr int BYTES = 128;
    static constexpr bool SCALED = false;
    static inline void decode(const uint8_t* p, v16 q[4]) {
        for (int h = 0; h < 4; ++h) q[h] = widen_bf16(p + 32 * h);
    }
};

template <class S>
inline void load_row(const S* p, v16 out[4]) {
    for (int h = 0; h < 4; ++h) out[h] = load_scales(p + 16 * h);
}

// The group's scales (and minimums) of the panel, widened to fp32.
template <class F, class S, bool MIN>
struct Group {
    v16 s[4], m[4];
    inline void load_group(const S* scales, const S* mins, int64_t g) {
        if constexpr (F::SCALED) {
            load_row(scales + g * PANEL, s);
            if constexpr (MIN) load_row(mins + g * PANEL, m);
        }
    }
    // The fp32 weights of one k: s * q + m. s * q is exact for the codes gguf ships (an fp16 scale, or a
    // K-quant's fp16 x 6-bit scale, times a code of at most 8 bits fits fp32's 24 bits), so fused or not, the
    // sum is rounded once, as gguf's dequantization rounds it.
    inline void weights(const uint8_t* codes, v16 w[4]) const {
        F::decode(codes, w);
        if constexpr (F::SCALED) {
            for (int h = 0; h < 4; ++h) w[h] = MIN ? w[h] * s[h] + m[h] : w[h] * s[h];
        }
    }
};

template <int RT>
inline void store_rows(v16 acc[][4], float* y, int64_t ldy, int cols) {
    for (int i = 0; i < RT; ++i) {
        if (cols == PANEL) {
            for (int h = 0; h < 4; ++h) store(y + i * ldy + 16 * h, acc[i][h]);
        } else {
            alignas(64) float row[PANEL];
            for (int h = 0; h < 4; ++h) store(row + 16 * h, acc[i][h]);
            std::memcpy(y + i * ldy, row, sizeof(float) * cols);
        }
    }
}

// RT rows of x against one panel, widening each k's codes once for all RT rows.
template <class F, class S, bool MIN, int RT>
void direct_tile(const float* x, int64_t ldx, const uint8_t* codes, const S* scales, const S* mins, int64_t k,
                 int64_t group, const float* bias, float* y, int64_t ldy, int cols) {
    v16 acc[RT][4];
    for (int h = 0; h < 4; ++h) {
        const v16 b = bias ? load(bias + 16 * h) : v16{};
        for (int i = 0; i < RT; ++i) acc[i][h] = b;
    }
    Group<F, S, MIN> grp;
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, ++g) {
        grp.load_group(scales, mins, g);
        if constexpr (F::SCALED) {  // a group's scales are a line or two of a stream too short to be prefetched
            for (int64_t b = 0; b < PANEL * (int64_t)sizeof(S); b += 64) {
                __builtin_prefetch(reinterpret_cast<const char*>(scales + (g + SCALES_AHEAD) * PANEL) + b);
                if constexpr (MIN) __builtin_prefetch(reinterpret_cast<const char*>(mins + (g + SCALES_AHEAD) * PANEL) + b);
            }
        }
        const int64_t g1 = std::min(k, g0 + group);
        for (int64_t kk = g0; kk < g1; ++kk) {
            v16 w[4];
            // Ask for the codes PREFETCH_BYTES ahead: the hardware's stream prefetcher stops at every 4 KiB page,
            // and decode is the weights' bytes streamed once from memory (reading past the panel's end is
            // harmless: a prefetch never faults).
            __builtin_prefetch(codes + kk * F::BYTES + PREFETCH_BYTES);
            grp.weights(codes + kk * F::BYTES, w);
            for (int i = 0; i < RT; ++i) {
                const v16 xb = splat(x[i * ldx + kk]);
                for (int h = 0; h < 4; ++h) acc[i][h] += xb * w[h];
            }
        }
    }
    store_rows<RT>(acc, y, ldy, cols);
}

// The fp32 weights of k0 <= k < k1 of a panel into buf, [k1 - k0][64].
template <class F, class S, bool MIN>
void decode_chunk(const uint8_t* codes, const S* scales, const S* mins, int64_t k0, int64_t k1, int64_t group,
                  float* buf) {
    Group<F, S, MIN> grp;
    for (int64_t g = k0 / group, kk = k0; kk < k1; ++g) {
        grp.load_group(scales, mins, g);
        for (const int64_t end = std::min(k1, (g + 1) * group); kk < end; ++kk) {
            v16 w[4];
            grp.weights(codes + kk * F::BYTES, w);
            for (int h = 0; h < 4; ++h) store(buf + (kk - k0) * PANEL + 16 * h, w[h]);
        }
    }
}

// acc [RT][64] (in memory) += x[RT][0:kc] times the chunk's fp32 weights, k in order.
template <int RT>
void chunk_tile(const float* x, int64_t ldx, const float* buf, int64_t kc, float* acc_rows) {
    v16 acc[RT][4];
    for (int i = 0; i < RT; ++i)
        for (int h = 0; h < 4; ++h) acc[i][h] = load(acc_rows + i * PANEL + 16 * h);
    panel_fma<RT>(acc, x, ldx, buf, kc);
    for (int i = 0; i < RT; ++i)
        for (int h = 0; h < 4; ++h) store(acc_rows + i * PANEL + 16 * h, acc[i][h]);
}

// The buffered path's decoded chunk and accumulators, per thread and kept between calls: too large for a
// thread's stack, and allocating them per task would fault fresh pages in every time.
float* scratch() {
    static thread_local std::vector<float> buffer((size_t)(CHUNK + BLOCK_ROWS) * PANEL);
    return buffer.data();
}

template <class F, class S, bool MIN>
void buffered_block(const float* x, int64_t ldx, int rows, const uint8_t* codes, const S* scales, const S* mins,
                    int64_t k, int64_t group, const float* bias, float* y, int64_t ldy, int cols) {
    float* buf = scratch();
    float* acc = buf + CHUNK * PANEL;
    for (int i = 0; i < rows; ++i) {
        if (bias) std::memcpy(acc + i * PANEL, bias, sizeof(float) * PANEL);
        else std::memset(acc + i * PANEL, 0, sizeof(float) * PANEL);
    }
    for (int64_t k0 = 0; k0 < k; k0 += CHUNK) {
        const int64_t k1 = std::min(k, k0 + CHUNK);
        decode_chunk<F, S, MIN>(codes, scales, mins, k0, k1, group, buf);
        for (int r = 0; r < rows; r += TILE_ROWS) {
            const float* xr = x + r * ldx + k0;
            float* ar = acc + r * PANEL;
            switch (std::min(TILE_ROWS, rows - r)) {
                case 6: chunk_tile<6>(xr, ldx, buf, k1 - k0, ar); break;
                case 5: chunk_tile<5>(xr, ldx, buf, k1 - k0, ar); break;
                case 4: chunk_tile<4>(xr, ldx, buf, k1 - k0, ar); break;
                case 3: chunk_tile<3>(xr, ldx, buf, k1 - k0, ar); break;
                case 2: chunk_tile<2>(xr, ldx, buf, k1 - k0, ar); break;
                default: chunk_tile<1>(xr, ldx, buf, k1 - k0, ar); break;
            }
        }
    }
    for (int i = 0; i < rows; ++i) std::memcpy(y + i * ldy, acc + i * PANEL, sizeof(float) * cols);
}

template <class F, class S, bool MIN>
void linear(const float* x, int64_t m, int64_t ldx, int64_t k, const uint8_t* panels, const S* scales,
            const S* mins, int64_t group, const float* bias, int64_t n, float* y, int num_threads) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    const int64_t groups = (k + group - 1) / group;
    const bool direct = m <= DIRECT_ROWS;
    // A task: one tile, or a block of tiles sharing the decoded chunks; blocks small enough that the
    // threads get several tasks each where the layer has few panels, large enough to amortize decoding.
    int64_t block_rows = DIRECT_TILE;
    if (!direct) {
        const int64_t blocks = std::max<int64_t>(1, (8 * num_threads + num_panels - 1) / num_panels);
        const int64_t rows = (m + blocks - 1) / blocks;
        block_rows = std::clamp<int64_t>((rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS, MIN_BLOCK_ROWS, BLOCK_ROWS);
    }
    const int64_t row_blocks = (m + block_rows - 1) / block_rows;
    const auto task = [&](int64_t p, int64_t r) {
        const int64_t r0 = r * block_rows;
        const int rows = (int)std::min<int64_t>(block_rows, m - r0);
        const int cols = (int)std::min<int64_t>(PANEL, n - p * PANEL);
        const float* xr = x + r0 * ldx;
        const uint8_t* codes = panels + p * k * F::BYTES;
        const S* sc = F::SCALED ? scales + p * groups * PANEL : nullptr;
        const S* mn = MIN ? mins + p * groups * PANEL : nullptr;
        const float* b = bias ? bias + p * PANEL : nullptr;
        float* yr = y + r0 * n + p * PANEL;
        if (!direct) {
            buffered_block<F, S, MIN>(xr, ldx, rows, codes, sc, mn, k, group, b, yr, n, cols);
            return;
        }
        switch (rows) {
            case 6: direct_tile<F, S, MIN, 6>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
            case 5: direct_tile<F, S, MIN, 5>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
            case 4: direct_tile<F, S, MIN, 4>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
            case 3: direct_tile<F, S, MIN, 3>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
            case 2: direct_tile<F, S, MIN, 2>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
            default: direct_tile<F, S, MIN, 1>(xr, ldx, codes, sc, mn, k, group, b, yr, n, cols); break;
        }
    };
    if (direct) {  // a few rows (decode): microseconds of work a call, shared without OpenMP's barrier
        // A task takes a span of consecutive panels, one stretch of memory: the weights stream from memory
        // faster in a few long runs than in one panel's 20-50 KiB per task (BENCHMARKS.md "Decode").
        const int64_t span = std::max<int64_t>(1, num_panels / (TASKS_PER_THREAD * num_threads));
        const int64_t spans = (num_panels + span - 1) / span;
        auto body = [&](int64_t t) {
            const int64_t first = t / row_blocks * span, r = t % row_blocks;
            for (int64_t p = first; p < std::min(num_panels, first + span); ++p) task(p, r);
        };
        share_tasks(spans * row_blocks, num_threads, body);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; ++p) {
        for (int64_t r = 0; r < row_blocks; ++r) task(p, r);
    }
}

template <class F>
void linear_format(const float* x, int64_t m, int64_t ldx, int64_t k, const uint8_t* panels, const void* scales,
                   const void* mins, int64_t half_scales, int64_t group, const float* bias, int64_t n, float* y,
                   int threads) {
    with_scales(half_scales, mins, [&](auto type, auto has_mins) {
        using S = decltype(type);
        linear<F, S, decltype(has_mins)::value>(x, m, ldx, k, panels, static_cast<const S*>(scales),
                                                static_cast<const S*>(mins), group, bias, n, y, threads);
    });
}

}  // namespace

// x: [m, k] fp32 with row stride ldx; panels: [ceil(n / 64)][k][bytes per k of the format]; scales, mins:
// [ceil(n / 64)][ceil(k / group)][64], fp16 when half_scales else fp32 (mins may be null; both unused for
// bf16); bias: [ceil(n / 64) * 64] fp32 or null; y: [m, n] contiguous. Returns 0, or -1 for arguments the
// kernel does not take.
extern "C" int kv_quant_linear_f32(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t format,
                                   const uint8_t* panels, const void* scales, const void* mins,
                                   int64_t half_scales, int64_t group, const float* bias, int64_t n, float* y,
                                   int64_t num_threads) {
    if (m < 0 || k <= 0 || n <= 0 || (format != BF16 && group <= 0)) return -1;
    if (m == 0) return 0;
    const int threads = (int)std::max<int64_t>(1, num_threads);
    const int64_t grp = format == BF16 ? k : group;
    switch (format) {
        case BF16: linear<Bf16, float, false>(x, m, ldx, k, panels, nullptr, nullptr, grp, bias, n, y, threads);
                   return 0;
        case INT8: linear_format<Int8>(x, m, ldx, k, panels, scales, mins, half_scales, grp, bias, n, y, threads);
                   return 0;
        case INT4: linear_format<Int4>(x, m, ldx, k, panels, scales, mins, half_scales, grp, bias, n, y, threads);
                   return 0;
        case INT8_A8:
        case INT4_A8:
            return kv_quant_linear_a8(x, m, ldx, k, format == INT8_A8, panels, scales, mins, half_scales, group, bias,
                                      n, y, num_threads);
        default: return -1;
    }
}

// Rows ids[0 .. count) of W as fp32, out: [count][k] (a tied model's embedding lookups, read out of its packed
// head): code * scale + minimum, rounded as quant_weights.dequantize_rows rounds them (the product, then the
// sum: never contracted into one FMA). The layouts are kv_quant_linear_f32's: a panel's int8 codes [k][64] and
// int4 [k][32] (column j in the low nibble, j + 32 in the high one), and with int8 activations the same in
// fours of k, [k / 4][64 or 32][4], int8 codes stored + 128. Returns -1 for bf16, which it does not read.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
extern "C" int kv_quant_rows(int64_t format, const uint8_t* panels, const void* scales, const void* mins,
                             int64_t half_scales, int64_t group, int64_t k, const int64_t* ids, int64_t count,
                             float* out) {
    if (format == BF16 || format > INT4_A8 || group <= 0 || k <= 0) return -1;
    const bool int8 = format == INT8 || format == INT8_A8, quads = format == INT8_A8 || format == INT4_A8;
    const int64_t width = int8 ? PANEL : PANEL / 2, groups = (k + group - 1) / group;  // bytes a k takes a panel
    const auto scale = [&](const void* t, int64_t at) {
        return half_scales ? (float)static_cast<const _Float16*>(t)[at] : static_cast<const float*>(t)[at];
    };
    for (int64_t r = 0; r < count; ++r) {
        const int64_t p = ids[r] / PANEL, c = ids[r] % PANEL, col = int8 ? c : c % (PANEL / 2);
        const int shift = int8 ? 0 : 4 * (int)(c / (PANEL / 2));
        const uint8_t* panel = panels + p * k * width;
        float* y = out + r * k;
        for (int64_t i = 0; i < k; ++i) {
            const uint8_t byte = quads ? panel[((i / 4) * width + col) * 4 + i % 4] : panel[i * width + col];
            const float q = int8 ? (quads ? (float)((int)byte - 128) : (float)(int8_t)byte)
                                 : (float)((byte >> shift) & 15);
            const int64_t at = (p * groups + i / group) * PANEL + c;
            float w = q * scale(scales, at);
            if (mins) w = w + scale(mins, at);
            y[i] = w;
        }
    }
    return 0;
}
#pragma GCC pop_options
