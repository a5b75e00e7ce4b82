// y = x W^T + b on int8/int4 weight codes with int8 activations (--activation-dtype int8): llama.cpp's way of
// running a quantized product. Each row of x is quantized per group of `group` inputs (the weights' group) to
// int8 codes with one fp32 scale, d = max|x| / 127; a group's products are then integer dot products, exact in
// int32, and only the group's sum meets the floats:
//     y[c] = b[c] + sum over groups g, in order, of d_g * (s_gc * sum_k q_kc xq_k + m_gc * sum_k xq_k)
// The codes are not widened to fp32, so a product costs a few integer instructions per 64 weights (AVX-512
// VNNI's vpdpbusd multiplies 64 byte pairs and adds them in fours) where the fp32 path (cpu_quant.cpp) widens,
// scales and multiplies every weight: decode becomes the weights' bytes read from memory. The logits are not
// fp32 activations' (the activations lose their low bits), which is why it is an option and not the default.
//
// A row's result depends only on that row (its quantization, exact integer sums, then its groups in order), so
// it is the same whatever rows share its step: prefix reuse stays exact, decode equals prefill bit for bit.
//
// Layout: panels of 64 output columns; per panel, per 4 consecutive inputs k (a "quad"), each column's 4 codes
// in one 32-bit lane, the form vpdpbusd takes. int8: 256 bytes a quad, bytes 64h .. 64h + 63 are columns
// 16h .. 16h + 15, codes stored + 128 (vpdpbusd multiplies unsigned by signed bytes; the 128 * sum(xq) it adds
// is taken back out). int4: 128 bytes a quad, bytes 0-63 columns 0-15 in the low nibbles and 32-47 in the high
// ones, bytes 64-127 columns 16-31 and 48-63. k and the group must be multiples of 4. Scales and minimums as
// cpu_quant.cpp: [panels][groups][64], fp32 or fp16. Without AVX-512 VNNI the same integer sums run in plain C++:
// slower, the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_scales.h"
#include "cpu_tasks.h"
#include "cpu_vector.h"

namespace {

using namespace kv;

constexpr int PANEL = 64;
constexpr int TILE = 8;          // rows that share a panel's int4 codes, a group at a time (tile)
constexpr int SUB_TILE = 4;      // of which share its unpacked codes and keep their dot products in registers
constexpr int BLOCK_ROWS = 64;   // rows of a task
// A call's panels go to TASKS_PER_THREAD tasks per thread, each a run of consecutive panels: the weights stream
// from memory faster in a few long runs than in a task per panel (20-50 KiB), and two a thread still let the
// caller take over a helper's share when the helper is not running (cpu_tasks.h).
constexpr int TASKS_PER_THREAD = 2;
// How far ahead a tile asks for its codes, into L2: with integer products a row costs little more than its
// weights' bytes, and 4 KiB ahead into L2 streamed a step's products ~5% faster than 2 KiB into L1 (median of
// 100 alternating rounds; the fp32-activation kernel, busier with arithmetic, was 3% slower with it).
constexpr int64_t PREFETCH_BYTES = 4096;
constexpr int64_t SCALES_AHEAD = 2;       // and for its groups' scales and minimums

// The activations of one call, quantized: codes [m][k], and per row and group its scale and its codes' sum.
struct Quantized {
    const int8_t* q;
    const float* d;
    const int32_t* sum;
    int64_t k, groups;
};

// Each lane rounded to the nearest integer, ties to even.
inline v16 round_even(v16 v) {
#if defined(__AVX512F__)
    __m512 r;
    std::memcpy(&r, &v, 64);
    r = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    std::memcpy(&v, &r, 64);
    return v;
#else
    for (int l = 0; l < LANES; ++l) v[l] = std::nearbyint(v[l]);
    return v;
#endif
}

// Row x (k inputs) into codes, per group: d = max|x| / 127, q = x * (1 / d) rounded to nearest even, and the
// codes' sum.
void quantize_row(const float* x, int64_t k, int64_t group, int8_t* q, float* d, int32_t* sum) {
    for (int64_t g0 = 0, g = 0; g0 < k; g0 += group, ++g) {
        const int64_t g1 = std::min(k, g0 + group);
        float amax = 0.0f;
        int64_t i = g0;
        v16 vmax_abs{};
        for (; i + LANES <= g1; i += LANES) {
            const v16 v = load(x + i);
            vmax_abs = vmax(vmax_abs, vmax(v, -v));
        }
#if defined(__AVX512F__)
        __m512 lanes;
        std::memcpy(&lanes, &vmax_abs, 64);
        amax = _mm512_reduce_max_ps(lanes);
#else
        for (int l = 0; l < LANES; ++l) amax = std::max(amax, vmax_abs[l]);
#endif
        for (; i < g1; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float scale = amax / 127.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        d[g] = scale;
        vi16 total{};
        i = g0;
        for (; i + LANES <= g1; i += LANES) {
            const v16 r = vmin(vmax(round_even(load(x + i) * inverse), splat(-127.0f)), splat(127.0f));
            const vi16 c = __builtin_convertvector(r, vi16);
            total += c;
#if defined(__AVX512F__)
            __m512i codes;
            std::memcpy(&codes, &c, 64);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(codes));
#else
            for (int l = 0; l < LANES; ++l) q[i + l] = (int8_t)c[l];
#endif
        }
        int32_t s = 0;
        for (int l = 0; l < LANES; ++l) s += total[l];
        for (; i < g1; ++i) {
            const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inverse)));
            q[i] = (int8_t)r;
            s += (int32_t)r;
        }
        sum[g] = s;
    }
}

// a * b + c rounded once, lane by lane. Spelled out rather than left to gcc's contraction of a * b + c, which
// may fuse either product of an expression: every path below shares these roundings.
inline v16 fma16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
    __m512 x, y, z;
    std::memcpy(&x, &a, 64);
    std::memcpy(&y, &b, 64);
    std::memcpy(&z, &c, 64);
    const __m512 r = _mm512_fmadd_ps(x, y, z);
    v16 out;
    std::memcpy(&out, &r, 64);
    return out;
#else
    v16 out;
    for (int l = 0; l < LANES; ++l) out[l] = std::fma(a[l], b[l], c[l]);
    return out;
#endif
}

// acc += d * (s * dot + m * sum) for one row's group over 64 columns: the one place the floats meet.
template <bool INT8, bool MIN, class S>
inline void combine(v16 acc[4], const vi16 dot[4], float d, int32_t sum, const S* s, const S* m) {
    const v16 dv = splat(d);
    const v16 sum_f = splat((float)sum);
    for (int h = 0; h < 4; ++h) {
        vi16 exact = dot[h];
        if constexpr (INT8) exact -= 128 * sum;  // the stored codes' offset, taken back out
        v16 t = __builtin_convertvector(exact, v16) * load_scales(s + 16 * h);
        if constexpr (MIN) t = fma16(load_scales(m + 16 * h), sum_f, t);
        acc[h] = fma16(dv, t, acc[h]);
    }
}

// The dot products of RT rows with one quad of a panel, into dot[RT][4] (16 columns each).
template <bool INT8, int RT>
inline void dot_quad(const uint8_t* codes, const int8_t* const xq[RT], int64_t quad, vi16 dot[RT][4]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i w[4];
    if constexpr (INT8) {
        for (int h = 0; h < 4; ++h) w[h] = _mm512_loadu_si512(codes + 64 * h);
    } else {
        const __m512i nibble = _mm512_set1_epi8(15);
        const __m512i a = _mm512_loadu_si512(codes), b = _mm512_loadu_si512(codes + 64);
        w[0] = _mm512_and_si512(a, nibble);
        w[1] = _mm512_and_si512(b, nibble);
        w[2] = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
        w[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
    }
    for (int i = 0; i < RT; ++i) {
        int32_t four;
        std::memcpy(&four, xq[i] + 4 * quad, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int h = 0; h < 4; ++h) {
            __m512i acc;
            std::memcpy(&acc, &dot[i][h], 64);
            acc = _mm512_dpbusd_epi32(acc, w[h], x);
            std::memcpy(&dot[i][h], &acc, 64);
        }
    }
#else
    for (int h = 0; h < 4; ++h) {
        for (int l = 0; l < LANES; ++l) {
            int32_t c[4];
            for (int j = 0; j < 4; ++j) {
                if constexpr (INT8) c[j] = codes[64 * h + 4 * l + j];
                else c[j] = (codes[64 * (h & 1) + 4 * l + j] >> (4 * (h >> 1))) & 15;
            }
            for (int i = 0; i < RT; ++i) {
                const int8_t* x = xq[i] + 4 * quad;
                dot[i][h][l] += c[0] * x[0] + c[1] * x[1] + c[2] * x[2] + c[3] * x[3];
            }
        }
    }
#endif
}

// One group of one panel for SR rows from r0: their dot products with the group's quads (in registers), then
// acc[i] += the group's share (combine). `ahead`: ask for the codes PREFETCH_BYTES ahead, into L2.
template <bool INT8, bool MIN, class S, int SR>
inline void group_rows(const Quantized& a, int64_t r0, const uint8_t* codes, int64_t q0, int64_t q1, int64_t g,
                       const S* s, const S* m, v16 (*acc)[4], bool ahead) {
    constexpr int64_t QUAD_BYTES = INT8 ? 256 : 128;
    const int8_t* xq[SR];
    for (int i = 0; i < SR; ++i) xq[i] = a.q + (r0 + i) * a.k;
    vi16 dot[SR][4];
    for (int i = 0; i < SR; ++i)
        for (int h = 0; h < 4; ++h) dot[i][h] = vi16{};
    for (int64_t quad = q0; quad < q1; ++quad) {
        if (ahead)
            for (int64_t b = 0; b < QUAD_BYTES; b += 64)
                __builtin_prefetch(codes + quad * QUAD_BYTES + PREFETCH_BYTES + b, 0, 1);
        dot_quad<INT8, SR>(codes + quad * QUAD_BYTES, xq, quad, dot);
    }
    for (int i = 0; i < SR; ++i) {
        const int64_t at = (r0 + i) * a.groups + g;
        combine<INT8, MIN, S>(acc[i], dot[i], a.d[at], a.sum[at], s, m);
    }
}

// RT rows of the quantized activations against one panel, a group at a time for all of them: rows past the
// first SUB_TILE take the group's codes (1-2 KiB) from L1 right after the first ones read them from memory, so
// the codes keep streaming while the later rows compute. (A tile of 4 rows over the whole panel, then the next
// 4 rows over it again from cache, left the memory idle during the second: 8 decode rows stalled on the codes.)
template <bool INT8, bool MIN, class S, int RT>
void tile(const Quantized& a, int64_t r0, const uint8_t* codes, const S* scales, const S* mins, int64_t group,
          const float* bias, float* y, int64_t ldy, int cols) {
    v16 acc[RT][4];
    for (int h = 0; h < 4; ++h) {
        const v16 b = bias ? load(bias + 16 * h) : v16{};
        for (int i = 0; i < RT; ++i) acc[i][h] = b;
    }
    for (int64_t g = 0; g < a.groups; ++g) {
        // The scales and minimums a few groups ahead: each group's are a cache line or two of their own
        // streams, too short for the hardware's prefetcher, and waiting for them stalls the codes' stream.
        for (int64_t b = 0; b < PANEL * (int64_t)sizeof(S); b += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(scales + (g + SCALES_AHEAD) * PANEL) + b);
            if constexpr (MIN) __builtin_prefetch(reinterpret_cast<const char*>(mins + (g + SCALES_AHEAD) * PANEL) + b);
        }
        const int64_t q0 = g * group / 4, q1 = std::min(a.k, (g + 1) * group) / 4;
        const S* s = scales + g * PANEL;
        const S* m = MIN ? mins + g * PANEL : nullptr;
        constexpr int FIRST = RT < SUB_TILE ? RT : SUB_TILE;
        group_rows<INT8, MIN, S, FIRST>(a, r0, codes, q0, q1, g, s, m, acc, true);
        if constexpr (RT > SUB_TILE)
            group_rows<INT8, MIN, S, RT - SUB_TILE>(a, r0 + SUB_TILE, codes, q0, q1, g, s, m, acc + SUB_TILE, false);
    }
    for (int i = 0; i < RT; ++i) {
        float* out = y + i * ldy;
        if (cols == PANEL) {
            for (int h = 0; h < 4; ++h) store(out + 16 * h, acc[i][h]);
        } else {
            alignas(64) float row[PANEL];
            for (int h = 0; h < 4; ++h) store(row + 16 * h, acc[i][h]);
            std::memcpy(out, row, sizeof(float) * cols);
        }
    }
}

// The calling thread's buffers for the quantized activations, kept between calls (a decode step makes ~120).
struct Buffers {
    std::vector<int8_t> q;
    std::vector<float> d;
    std::vector<int32_t> sum;
};

Buffers& buffers() {
    static thread_local Buffers b;
    return b;
}

template <bool INT8, bool MIN, class S>
void linear(const float* x, int64_t m, int64_t ldx, int64_t k, const uint8_t* panels, const S* scales,
            const S* mins, int64_t group, const float* bias, int64_t n, float* y, int threads) {
    constexpr int64_t QUAD_BYTES = INT8 ? 256 : 128;
    const int64_t groups = (k + group - 1) / group;
    Buffers& buf = buffers();
    if ((int64_t)buf.q.size() < m * k) buf.q.resize(m * k);
    if ((int64_t)buf.d.size() < m * groups) {
        buf.d.resize(m * groups);
        buf.sum.resize(m * groups);
    }
    int8_t* q = buf.q.data();
    float* d = buf.d.data();
    int32_t* sum = buf.sum.data();
    const Quantized a{q, d, sum, k, groups};
    auto quantize = [&](int64_t r) { quantize_row(x + r * ldx, k, group, q + r * k, d + r * groups, sum + r * groups); };
    share_tasks(m, m >= 8 ? threads : 1, quantize);

    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    const int64_t row_blocks = (m + BLOCK_ROWS - 1) / BLOCK_ROWS;
    // A task: SPAN consecutive panels (one stretch of memory) for a block of rows.
    const int64_t span = std::max<int64_t>(1, num_panels / (TASKS_PER_THREAD * threads));
    const int64_t spans = (num_panels + span - 1) / span;
    // int8 codes (the head) keep tiles of SUB_TILE rows over the whole panel: one real step's 8-row products
    // replayed through both builds, 60 alternating rounds, the int4 layers went 3.27 -> 3.05 ms (median) with
    // tiles of TILE rows and the int8 head 0.78 -> 0.91 ms, so the head keeps what it had.
    constexpr int64_t tile_rows = INT8 ? SUB_TILE : TILE;
    auto task = [&](int64_t t) {
        const int64_t first = t / row_blocks * span, r0 = t % row_blocks * BLOCK_ROWS;
        const int64_t r1 = std::min(m, r0 + BLOCK_ROWS);
        for (int64_t p = first; p < std::min(num_panels, first + span); ++p) {
            const int cols = (int)std::min<int64_t>(PANEL, n - p * PANEL);
            const uint8_t* codes = panels + p * (k / 4) * QUAD_BYTES;
            const S* sc = scales + p * groups * PANEL;
            const S* mn = MIN ? mins + p * groups * PANEL : nullptr;
            const float* b = bias ? bias + p * PANEL : nullptr;
            for (int64_t r = r0; r < r1; r += tile_rows) {
                float* yr = y + r * n + p * PANEL;
                switch (std::min<int64_t>(tile_rows, r1 - r)) {
                    case 8: tile<INT8, MIN, S, 8>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 7: tile<INT8, MIN, S, 7>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 6: tile<INT8, MIN, S, 6>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 5: tile<INT8, MIN, S, 5>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 4: tile<INT8, MIN, S, 4>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 3: tile<INT8, MIN, S, 3>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    case 2: tile<INT8, MIN, S, 2>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                    default: tile<INT8, MIN, S, 1>(a, r, codes, sc, mn, group, b, yr, n, cols); break;
                }
            }
        }
    };
    share_tasks(spans * row_blocks, threads, task);
}

}  // namespace

// As kv_quant_linear_f32 (which hands formats INT8_A8 and INT4_A8 here), with the layout above. Returns 0, or
// -1 for arguments the kernel does not take (k or the group not a multiple of 4, no scales).
int kv_quant_linear_a8(const float* x, int64_t m, int64_t ldx, int64_t k, int64_t int8, const uint8_t* panels,
                       const void* scales, const void* mins, int64_t half_scales, int64_t group, const float* bias,
                       int64_t n, float* y, int64_t num_threads) {
    if (m < 0 || k <= 0 || n <= 0 || group <= 0 || k % 4 || group % 4 || scales == nullptr) return -1;
    if (m == 0) return 0;
    const int threads = (int)std::max<int64_t>(1, num_threads);
    with_scales(half_scales, mins, [&](auto type, auto has_mins) {
        using S = decltype(type);
        constexpr bool MIN = decltype(has_mins)::value;
        const S* sc = static_cast<const S*>(scales);
        const S* mn = static_cast<const S*>(mins);
        if (int8) linear<true, MIN, S>(x, m, ldx, k, panels, sc, mn, group, bias, n, y, threads);
        else linear<false, MIN, S>(x, m, ldx, k, panels, sc, mn, group, bias, n, y, threads);
    });
    return 0;
}
