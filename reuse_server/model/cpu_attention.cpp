// Paged attention on the CPU, fp32 arithmetic: query tokens at arbitrary positions against their sequence's
// KV blocks in the pool, read in place through the block table (no gathered copy of K/V). The pool stores
// K/V as fp32, fp16, bf16, fp8 e4m3 (a scale per block and KV head) or int8 (a scale per token and KV head);
// the other formats are widened to fp32 as they are read: each chunk's K rows into a small fp32 tile that
// the score tiles broadcast from, V rows in registers as the output accumulates. The fp32 pool is read as
// before, with no conversion.
//
// Work unit: one sequence, one KV head, up to 64 query rows (the query heads sharing that KV head, folded:
// row = token * group + head-in-group). Rows are the vector lanes: scores are computed transposed,
// S^T[key][row] = sum_d K[key][d] * Q^T[d][row], with each key element broadcast against 16 rows at a time,
// so K rows are read straight from the pool and the online softmax runs lane-wise, without horizontal
// reductions. Then O[row][:] += P[row][key] * V[key][:] over 24/(head_dim/16) rows at a time. A unit with
// few units beside it splits its keys into several tasks (flash-decoding) whose partial results are merged.
// Compiled at first use with the host's own instruction set (see native.py); gcc vector extensions
// become AVX-512, AVX2 or SSE code.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "cpu_kernels.h"
#include "cpu_tasks.h"

#include "cpu_vector.h"

namespace {

using namespace kv;

// ---- KV storage formats ---------------------------------------------------------------------------------
// The element types as stored; widen() reads 16 consecutive elements as fp32 lanes, times Format::unit.
struct Half { uint16_t bits; };
struct BFloat { uint16_t bits; };
struct Fp8 { uint8_t bits; };  // e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits

template <typename T> struct Format;
// scaled: a fp32 scale per block (fp8) or per token (int8) and KV head multiplies every element
template <> struct Format<float> { static constexpr bool scaled = false, per_token = false; static constexpr float unit = 1.f; };
template <> struct Format<Half> { static constexpr bool scaled = false, per_token = false; static constexpr float unit = 1.f; };
template <> struct Format<BFloat> { static constexpr bool scaled = false, per_token = false; static constexpr float unit = 1.f; };
// fp8 is widened through fp16 (its bits shifted into an fp16's), which reads it at 1/256 of its value
template <> struct Format<Fp8> { static constexpr bool scaled = true, per_token = false; static constexpr float unit = 256.f; };
template <> struct Format<int8_t> { static constexpr bool scaled = true, per_token = true; static constexpr float unit = 1.f; };

inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float magnitude;
    if (exponent == 0) magnitude = std::ldexp((float)mantissa, -24);
    else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
    else magnitude = std::ldexp((float)(mantissa | 0x400), (int)exponent - 25);
    uint32_t bits;
    std::memcpy(&bits, &magnitude, 4);
    bits |= sign;
    std::memcpy(&magnitude, &bits, 4);
    return magnitude;
}

// e4m3 bits in place of an fp16's sign, exponent and top mantissa bits: the same number, 2^-8 of it
inline uint16_t fp8_as_half(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }

inline v16 widen(const float* p) { return load(p); }

inline v16 widen(const BFloat* p) {
    typedef uint16_t u16x16 __attribute__((vector_size(32)));
    typedef uint32_t u32x16 __attribute__((vector_size(64)));
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    return (v16)(__builtin_convertvector(h, u32x16) << 16);  // bf16 is the top half of an fp32
}

#if defined(__AVX512F__)
inline v16 widen(const Half* p) { return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline v16 widen(const int8_t* p) {
    return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline v16 widen(const Fp8* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7);
    return (v16)_mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}
#else
inline v16 widen(const Half* p) {
    alignas(64) float f[LANES];
    for (int i = 0; i < LANES; ++i) f[i] = half_to_float(p[i].bits);
    return load(f);
}
inline v16 widen(const int8_t* p) {
    alignas(64) float f[LANES];
    for (int i = 0; i < LANES; ++i) f[i] = (float)p[i];
    return load(f);
}
inline v16 widen(const Fp8* p) {
    alignas(64) float f[LANES];
    for (int i = 0; i < LANES; ++i) f[i] = half_to_float(fp8_as_half(p[i].bits));
    return load(f);
}
#endif

constexpr int CHUNK = 64;              // keys per online-softmax step
constexpr int MAX_ROWS = 64;           // query rows per unit (4 vectors)
constexpr int PAD_ROWS = MAX_ROWS + 24;  // the PV tiles may run past the last row
constexpr int MAX_HEAD_DIM = 256;
constexpr int64_t MIN_SPLIT_KEYS = 512;
// Query rows x keys below which one thread runs a call: 8 decode streams 100 keys in (7,200) read 37 MB of K/V a
// step, and two threads took them from 4.9 to 3.0 ms over SmolLM2's 30 layers; one stream there (900) stays serial.
constexpr int64_t SERIAL_ROW_KEYS = 2048;

struct Unit {
    int64_t seq, head, row0, rows, key_begin, key_end;
    int64_t first_task, num_tasks;
};
struct Task {
    int64_t unit, key_begin, key_end;
};

// S^T rows for KT keys: st[k * MAX_ROWS + lane] for RV vectors of rows.
template <int RV, int KT>
inline void score_tile(const float* const* krow, const float* qt, int hd, float* st) {
    v16 acc[KT][RV];
    for (int k = 0; k < KT; ++k)
        for (int v = 0; v < RV; ++v) acc[k][v] = v16{};
    for (int d = 0; d < hd; ++d) {
        v16 q[RV];
        for (int v = 0; v < RV; ++v) q[v] = load(qt + d * MAX_ROWS + v * LANES);
        for (int k = 0; k < KT; ++k) {
            const v16 kb = splat(krow[k][d]);
            for (int v = 0; v < RV; ++v) acc[k][v] += kb * q[v];
        }
    }
    for (int k = 0; k < KT; ++k)
        for (int v = 0; v < RV; ++v) store(st + k * MAX_ROWS + v * LANES, acc[k][v]);
}

// Pool rows of the next chunk, requested into L2 a few at a time while this chunk computes: the rows are
// short pieces of scattered slots, which the hardware prefetcher does not follow (17 queries over 4,097 keys
// read from memory: 44.3 -> 40.6 ms for 30 layers; into L1, or all at once at the chunk's start, no gain).
template <typename T>
inline void prefetch_rows(const T* const* rows, int from, int to, int n, int hd) {
    const int bytes = hd * (int)sizeof(T);
    for (int k = from; k < std::min(to, n); ++k) {
        const char* row = (const char*)rows[k];
#pragma GCC unroll 8
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 1);
    }
}

// The next chunk's pool rows (K rows, then V rows), asked for a few lines at a time from inside this chunk's
// loops. Asked for all at once, they filled the core's few outstanding-miss slots and the loads behind them
// waited, so the chunk's arithmetic ran after its reads instead of beside them.
template <typename T>
struct Ahead {
    const T* const* k = nullptr;
    const T* const* v = nullptr;
    int keys = 0, bytes = 0;  // rows of each of k and v; bytes a row
    int row = 0;              // the next row: k rows first (row < keys), then v rows
    void start(const T* const* k_rows, const T* const* v_rows, int n, int hd) {
        k = k_rows; v = v_rows; keys = n; bytes = hd * (int)sizeof(T); row = 0;
    }
    // the next `count` rows' lines
    inline void ask(int count) {
        for (; count > 0 && row < 2 * keys; --count, ++row) {
            const char* r = (const char*)(row < keys ? k[row] : v[row - keys]);
#pragma GCC unroll 8
            for (int b = 0; b < bytes; b += 64) __builtin_prefetch(r + b, 0, 1);
        }
    }
    inline void rest() { ask(2 * keys); }
};

template <int RV, typename T>
void score_chunk(const float* const* krow, int keys, const float* qt, int hd, float* st,
                 const T* const* knext, const T* const* vnext, int nnext) {
    constexpr int KT = RV >= 3 ? 6 : (RV == 2 ? 8 : 12);  // accumulators: KT * RV <= 24 of 32 registers
    int k = 0;
    for (; k + KT <= keys; k += KT) {
        prefetch_rows(knext, k, k + KT, nnext, hd);
        prefetch_rows(vnext, k, k + KT, nnext, hd);
        score_tile<RV, KT>(krow + k, qt, hd, st + k * MAX_ROWS);
    }
    for (; k < keys; ++k) score_tile<RV, 1>(krow + k, qt, hd, st + k * MAX_ROWS);
}

// o[i][:] += sum_k p[k * key_stride + i * row_stride] * vrow[k][:] for RT rows i, keys in order; vscale[k]: row
// k's scale (scaled formats). Each row's sums are its own: which tile computes a row never changes it.
template <int HV, int RT, typename T>
inline void value_tile(const T* const* vrow, const float* vscale, int keys, const float* p, int key_stride,
                       int row_stride, float* o, int hd, Ahead<T>* ahead = nullptr) {
    v16 acc[RT][HV];
    for (int i = 0; i < RT; ++i)
        for (int h = 0; h < HV; ++h) acc[i][h] = load(o + i * hd + h * LANES);
    for (int k = 0; k < keys; ++k) {
        if (ahead) ahead->ask(1);
        v16 vv[HV];
        for (int h = 0; h < HV; ++h) vv[h] = widen(vrow[k] + h * LANES);
        if constexpr (Format<T>::scaled)
            for (int h = 0; h < HV; ++h) vv[h] *= splat(vscale[k]);
        const float* pk = p + k * key_stride;
        for (int i = 0; i < RT; ++i) {
            const v16 pb = splat(pk[i * row_stride]);
            for (int h = 0; h < HV; ++h) acc[i][h] += pb * vv[h];
        }
    }
    for (int i = 0; i < RT; ++i)
        for (int h = 0; h < HV; ++h) store(o + i * hd + h * LANES, acc[i][h]);
}

// o[row][:] += sum_k p[k * MAX_ROWS + row] * vrow[k][:], for rows 0..rows-1 (rounded up to the tile).
template <int HV, typename T>
void value_chunk(const T* const* vrow, const float* vscale, int keys, const float* p, int rows, float* o, int hd) {
    constexpr int RT = 24 / HV;
    for (int i0 = 0; i0 < rows; i0 += RT)
        value_tile<HV, RT>(vrow, vscale, keys, p + i0, MAX_ROWS, 1, o + i0 * hd, hd);
}

// ---- Few rows (a decode step: one token's query heads of a KV head) -------------------------------------
// With rows as lanes, a unit of 3 rows fills 3 of 16 lanes: its scores, softmax and values cost what 16 rows
// cost. With up to 16 rows the chunk runs keys as lanes instead: its K rows transposed once (kt[d][key]), each
// row's scores 16 keys a vector, its exponentials likewise, then its values in a tile of its own rows. Every
// number is computed as the rows-as-lanes path computes it (the same products summed over d in order, the same
// exponential lane by lane, each row's sum over keys in key order), so a token's output has the same bits
// decoded alone as among a prefill's rows (tests/model/test_cpu_attention.py).
#if defined(__AVX512F__)
constexpr bool KEYS_AS_LANES = true;

// 16 rows of 16 floats, transposed in registers: r[c] becomes column c.
inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // s[4i + c]: in 128-bit lane l, column 4l + c of rows 4i .. 4i + 3
    __m512 s[16];
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        s[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        s[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        s[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        s[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; ++c) {
        const __m512 lo_a = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x44), lo_b = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x44);
        const __m512 hi_a = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xee), hi_b = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xee);
        r[c] = _mm512_shuffle_f32x4(lo_a, lo_b, 0x88);
        r[4 + c] = _mm512_shuffle_f32x4(lo_a, lo_b, 0xdd);
        r[8 + c] = _mm512_shuffle_f32x4(hi_a, hi_b, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(hi_a, hi_b, 0xdd);
    }
}

// kt[d][j] = kq[j][d] for the chunk's keys, zeros for the columns past them (a whole CHUNK of columns).
template <typename T>
void transpose_keys(const float* const* kq, int keys, int hd, float* kt, Ahead<T>& ahead) {
    alignas(64) static const float zeros[MAX_HEAD_DIM] = {};
    for (int j0 = 0; j0 < CHUNK; j0 += LANES) {
        if (j0 >= keys) {
            for (int d = 0; d < hd; ++d) _mm512_store_ps(kt + d * CHUNK + j0, _mm512_setzero_ps());
            continue;
        }
        const float* src[LANES];
        for (int j = 0; j < LANES; ++j) src[j] = j0 + j < keys ? kq[j0 + j] : zeros;
        for (int d0 = 0; d0 < hd; d0 += LANES) {
            __m512 r[16];
            for (int j = 0; j < LANES; ++j) r[j] = _mm512_loadu_ps(src[j] + d0);
            ahead.ask(2);
            transpose16(r);
            for (int c = 0; c < LANES; ++c) _mm512_store_ps(kt + (d0 + c) * CHUNK + j0, r[c]);
        }
    }
}

// sc[i][j] (row r0 + i, key j of the chunk) = sum over d in order of qt[d][r0 + i] * kt[d][j], NR rows at once.
template <int NR, typename T>
inline void key_scores(const float* qt, int r0, const float* kt, int hd, float* sc, Ahead<T>& ahead) {
    v16 acc[NR][CHUNK / LANES];
    for (int i = 0; i < NR; ++i)
        for (int g = 0; g < CHUNK / LANES; ++g) acc[i][g] = v16{};
    for (int d = 0; d < hd; ++d) {
        ahead.ask(1);
        v16 kv[CHUNK / LANES];
        for (int g = 0; g < CHUNK / LANES; ++g) kv[g] = load(kt + d * CHUNK + g * LANES);
        for (int i = 0; i < NR; ++i) {
            const v16 qb = splat(qt[d * MAX_ROWS + r0 + i]);
            for (int g = 0; g < CHUNK / LANES; ++g) acc[i][g] += kv[g] * qb;
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int g = 0; g < CHUNK / LANES; ++g) store(sc + (r0 + i) * CHUNK + g * LANES, acc[i][g]);
}

inline float lanes_max(v16 v) {
    __m512 x;
    std::memcpy(&x, &v, sizeof x);
    return _mm512_reduce_max_ps(x);
}

// o[i][:] += sum_k p[i * CHUNK + k] * vrow[k][:] for rows 0..rows-1, in tiles of exactly the rows there are.
template <int HV, typename T>
void value_rows(const T* const* vrow, const float* vscale, int keys, const float* p, int rows, float* o, int hd,
                Ahead<T>& ahead) {
    constexpr int TILE = HV >= 16 ? 1 : HV >= 8 ? 3 : 6;
    for (int i0 = 0; i0 < rows; i0 += TILE) {
        const float* pi = p + i0 * CHUNK;
        float* oi = o + i0 * hd;
        switch (std::min(TILE, rows - i0)) {
            case 1: value_tile<HV, 1>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
            case 2: value_tile<HV, 2>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
            case 3: value_tile<HV, 3>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
            case 4: value_tile<HV, 4>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
            case 5: value_tile<HV, 5>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
            default: value_tile<HV, 6>(vrow, vscale, keys, pi, 1, CHUNK, oi, hd, &ahead); break;
        }
    }
}
#else
constexpr bool KEYS_AS_LANES = false;
#endif

// The rows value_chunk runs for a unit of `rows` rows: whole tiles of its RT.
inline int64_t pv_tile_rows(int64_t rows, int64_t hd) {
    const int64_t rt = 24 / (hd / LANES);
    return (rows + rt - 1) / rt * rt;
}

struct Problem {
    const float* q;
    int64_t q_token_stride;
    float* out;
    const void* k_pool;
    const void* v_pool;
    const float* k_scales;  // scaled formats: [blocks][kv_heads] (fp8) or [slots][kv_heads] (int8)
    const float* v_scales;
    const int64_t* seq_info;  // per sequence: first query token, end query token, context length, table offset
    const int64_t* block_tables;
    const int64_t* positions;
    int64_t heads, kv_heads, hd, block_size, window;
    float scale;
};

#if defined(__AVX512F__)
// sums[i] += p[i * CHUNK + j] over the chunk's keys j in order, for NR rows: each row's sum in key order, as a
// row's lane adds them in the rows-as-lanes path. The rows side by side, in registers, so that their additions
// overlap instead of each waiting on the one before (through memory, they did).
template <int NR>
inline void row_sums(const float* p, int keys, float* sums) {
    float acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = sums[i];
    for (int j = 0; j < keys; ++j)
        for (int i = 0; i < NR; ++i) acc[i] += p[i * CHUNK + j];
    for (int i = 0; i < NR; ++i) sums[i] = acc[i];
}

// A chunk's scores and softmax for up to 16 rows, keys as lanes (see KEYS_AS_LANES): leaves each row's weights
// in sc[row][key], and its running max, exp-sum and rescale factor in m, l and alpha, as the rows-as-lanes code
// below computes them.
template <typename T>
void few_rows_chunk(const float* const* kq, int keys, int64_t j0, bool masked, const float* hi, const float* lo,
                    const float* qt, int hd, int rows, float* kt, float* sc, float* m, float* l, float* alpha,
                    Ahead<T>& ahead) {
    transpose_keys<T>(kq, keys, hd, kt, ahead);
    int r = 0;
    for (; r + 4 <= rows; r += 4) key_scores<4>(qt, r, kt, hd, sc, ahead);
    switch (rows - r) {
        case 3: key_scores<3>(qt, r, kt, hd, sc, ahead); break;
        case 2: key_scores<2>(qt, r, kt, hd, sc, ahead); break;
        case 1: key_scores<1>(qt, r, kt, hd, sc, ahead); break;
        default: break;
    }
    const int groups = (keys + LANES - 1) / LANES;
    v16 lane{};
    for (int j = 0; j < LANES; ++j) lane[j] = (float)j;
    const v16 end = splat((float)(j0 + keys));
    alignas(64) float mx[LANES], sums[LANES];
    for (int i = 0; i < LANES; ++i) {
        mx[i] = -INFINITY;
        sums[i] = 0.f;
    }
    for (int i = 0; i < rows; ++i) {
        float* si = sc + i * CHUNK;
        v16 top = splat(-INFINITY);
        for (int g = 0; g < groups; ++g) {
            const v16 key = splat((float)(j0 + g * LANES)) + lane;
            v16 s = load(si + g * LANES);
            if (masked) {
                s = (key <= splat(hi[i])) & (key >= splat(lo[i])) ? s : splat(-INFINITY);
                store(si + g * LANES, s);
            }
            top = vmax(top, key < end ? s : splat(-INFINITY));
        }
        mx[i] = lanes_max(top);
    }
    const v16 m_old = load(m);
    const v16 m_new = vmax(m_old, load(mx));
    // rows that have seen no visible key yet keep m = -inf, l = 0, o = 0
    const v16 shift = m_new == splat(-INFINITY) ? splat(0.f) : m_new;
    const v16 a = m_old == splat(-INFINITY) ? splat(0.f) : vexp(m_old - shift);
    alignas(64) float shifts[LANES];
    store(shifts, shift);
    for (int i = 0; i < rows; ++i) {
        float* si = sc + i * CHUNK;
        for (int g = 0; g < groups; ++g) {
            const v16 s = load(si + g * LANES);
            v16 p = vexp(s - splat(shifts[i]));
            if (masked) p = s == splat(-INFINITY) ? splat(0.f) : p;
            store(si + g * LANES, p);
        }
    }
    int i = 0;
    for (; i + 4 <= rows; i += 4) row_sums<4>(sc + i * CHUNK, keys, sums + i);
    switch (rows - i) {
        case 3: row_sums<3>(sc + i * CHUNK, keys, sums + i); break;
        case 2: row_sums<2>(sc + i * CHUNK, keys, sums + i); break;
        case 1: row_sums<1>(sc + i * CHUNK, keys, sums + i); break;
        default: break;
    }
    store(l, load(l) * a + load(sums));
    store(m, m_new);
    store(alpha, a);
}
#endif

// Unit u's K and V rows in the pool for keys [j0, min(j0 + CHUNK, key_end)), and their scales (scaled
// formats); returns how many.
template <typename T>
int chunk_rows(const Problem& pb, const Unit& u, int64_t j0, int64_t key_end, const T** kr, const T** vr,
               float* ks, float* vs) {
    const T* k_pool = (const T*)pb.k_pool;
    const T* v_pool = (const T*)pb.v_pool;
    const int64_t* table = pb.block_tables + pb.seq_info[4 * u.seq + 3];
    const int64_t kv_stride = pb.kv_heads * pb.hd;
    const int keys = (int)std::max<int64_t>(0, std::min<int64_t>(CHUNK, key_end - j0));
    // a block's keys at a time: one division a chunk, not one a key
    int64_t b = j0 / pb.block_size, offset = j0 % pb.block_size;
    for (int j = 0; j < keys; ++b, offset = 0) {
        const int64_t block = table[b];
        for (int64_t slot = block * pb.block_size + offset, end = (block + 1) * pb.block_size;
             slot < end && j < keys; ++slot, ++j) {
            kr[j] = k_pool + slot * kv_stride + u.head * pb.hd;
            vr[j] = v_pool + slot * kv_stride + u.head * pb.hd;
            if constexpr (Format<T>::scaled) {
                const int64_t at = (Format<T>::per_token ? slot : block) * pb.kv_heads + u.head;
                ks[j] = pb.k_scales[at] * Format<T>::unit;
                vs[j] = pb.v_scales[at] * Format<T>::unit;
            }
        }
    }
    return keys;
}

// One task: a unit's rows against keys [key_begin, key_end). Leaves the unnormalized output rows in o
// ([PAD_ROWS][hd]) and each row's running max and exp-sum in m and l. A few-rows task asks for the first chunk
// of `then` (the task its thread runs next, or null) during its own last one; `warm`: this task's first chunk
// was asked for so.
template <typename T>
void run_task(const Problem& pb, const Unit& u, int64_t key_begin, int64_t key_end, float* o, float* m, float* l,
              const Unit* then = nullptr, int64_t then_begin = 0, int64_t then_end = 0, bool warm = false) {
    constexpr bool plain = std::is_same_v<T, float>;
    alignas(64) float qt[MAX_HEAD_DIM * MAX_ROWS];
    alignas(64) float st[CHUNK * MAX_ROWS + 32];  // + the PV tiles' overrun past the last row
    alignas(64) float hi[MAX_ROWS], lo[MAX_ROWS], alpha[MAX_ROWS];
    // few rows (KEYS_AS_LANES): the chunk's K transposed, and each row's scores, then weights, over its keys
    alignas(64) float kt[KEYS_AS_LANES ? MAX_HEAD_DIM * CHUNK : 1];
    alignas(64) float sc[KEYS_AS_LANES ? LANES * CHUNK : 1];
    const T* rows[4][CHUNK];  // this chunk's K and V rows in the pool, and the next chunk's
    const T** krow = rows[0];
    const T** vrow = rows[1];
    const T** knext = rows[2];
    const T** vnext = rows[3];
    Ahead<T> ahead;  // few rows: the next chunk's rows, asked for from inside this chunk's loops
    // other formats: this chunk's K rows widened to fp32 (ktile, read through kf), and each row's scales
    alignas(64) float ktile[plain ? 1 : CHUNK * MAX_HEAD_DIM];
    const float* kf[CHUNK];
    alignas(64) float scales[4][Format<T>::scaled ? CHUNK : 1];
    float* kscale = scales[0];
    float* vscale = scales[1];
    float* kscale_next = scales[2];
    float* vscale_next = scales[3];
    const int hd = (int)pb.hd;
    const int64_t group = pb.heads / pb.kv_heads;
    const int64_t* info = pb.seq_info + 4 * u.seq;
    const int64_t q0 = info[0];
    const int rv = (int)((u.rows + LANES - 1) / LANES);
    const bool few = KEYS_AS_LANES && rv == 1;

    // Zeroed: only what is read and not written first (a decode unit has a few rows of the 64 these buffers
    // hold; zeroing all of them cost more than its attention). The score tiles read q's lanes up to rv vectors;
    // the PV tiles read rows up to a whole tile (pv_rows): its lanes past rv vectors of the scores, its rows of o.
    const int64_t lanes = rv * LANES;
    const int64_t pv_rows = pv_tile_rows(u.rows, hd);
    for (int d = 0; d < hd; ++d) std::fill(qt + d * MAX_ROWS + u.rows, qt + d * MAX_ROWS + lanes, 0.f);
    if (pv_rows > lanes)
        for (int k = 0; k < CHUNK; ++k) std::fill(st + k * MAX_ROWS + lanes, st + k * MAX_ROWS + pv_rows, 0.f);
    float min_hi = INFINITY, max_lo = -INFINITY;
    for (int r = 0; r < MAX_ROWS; ++r) { hi[r] = INFINITY; lo[r] = -INFINITY; }
    for (int64_t r = 0; r < u.rows; ++r) {
        const int64_t row = u.row0 + r, token = q0 + row / group;
        const float* qr = pb.q + token * pb.q_token_stride + (u.head * group + row % group) * hd;
        for (int d = 0; d < hd; ++d) qt[d * MAX_ROWS + r] = qr[d] * pb.scale;
        hi[r] = (float)pb.positions[token];  // a row sees keys lo[r] <= key <= hi[r]
        if (pb.window > 0) lo[r] = (float)(pb.positions[token] - pb.window + 1);
        min_hi = std::min(min_hi, hi[r]);
        max_lo = std::max(max_lo, lo[r]);
    }
    std::memset(o, 0, sizeof(float) * pv_rows * hd);
    for (int r = 0; r < MAX_ROWS; ++r) { m[r] = -INFINITY; l[r] = 0.f; }

    int next_keys = chunk_rows<T>(pb, u, key_begin, key_end, knext, vnext, kscale_next, vscale_next);
    // The first chunk's rows too (each later chunk's are asked for while the one before computes): a decode
    // unit of a short context is one or two chunks, and waiting on their rows one by one was most of its time
    // (8 streams 100 tokens in, 30 layers: 2.47 -> 1.90 ms).
    if (!(few && warm)) {
        prefetch_rows(knext, 0, next_keys, next_keys, hd);
        prefetch_rows(vnext, 0, next_keys, next_keys, hd);
    }
    for (int64_t j0 = key_begin; j0 < key_end; j0 += CHUNK) {
        std::swap(krow, knext);
        std::swap(vrow, vnext);
        std::swap(kscale, kscale_next);
        std::swap(vscale, vscale_next);
        const int keys = next_keys;
        next_keys = chunk_rows<T>(pb, u, j0 + CHUNK, key_end, knext, vnext, kscale_next, vscale_next);
        if (few) {
            if (next_keys > 0 || then == nullptr) {
                ahead.start(knext, vnext, next_keys, hd);
            } else {  // the last chunk: ask for the next task's first (knext, vnext are free now)
                const int n = chunk_rows<T>(pb, *then, then_begin, then_end, knext, vnext, kscale_next, vscale_next);
                ahead.start(knext, vnext, n, hd);
            }
        }
        const float* const* kq;  // the chunk's K rows in fp32
        if constexpr (plain) {
            kq = krow;
        } else {
            for (int j = 0; j < keys; ++j) {
                float* dst = ktile + j * hd;
                for (int d = 0; d < hd; d += LANES) {
                    v16 x = widen(krow[j] + d);
                    if constexpr (Format<T>::scaled) x *= splat(kscale[j]);
                    store(dst + d, x);
                }
                kf[j] = dst;
            }
            kq = kf;
        }
        const bool masked = (float)(j0 + keys - 1) > min_hi || (float)j0 < max_lo;
        if (few) {
#if defined(__AVX512F__)
            few_rows_chunk<T>(kq, keys, j0, masked, hi, lo, qt, hd, (int)u.rows, kt, sc, m, l, alpha, ahead);
#endif
        } else {
            switch (rv) {
                case 1: score_chunk<1>(kq, keys, qt, hd, st, knext, vnext, next_keys); break;
                case 2: score_chunk<2>(kq, keys, qt, hd, st, knext, vnext, next_keys); break;
                case 3: score_chunk<3>(kq, keys, qt, hd, st, knext, vnext, next_keys); break;
                default: score_chunk<4>(kq, keys, qt, hd, st, knext, vnext, next_keys); break;
            }
            for (int v = 0; v < rv; ++v) {
                float* sv = st + v * LANES;
                v16 mx = splat(-INFINITY);
                if (masked) {
                    const v16 hv = load(hi + v * LANES), lv = load(lo + v * LANES);
                    for (int j = 0; j < keys; ++j) {
                        const v16 key = splat((float)(j0 + j));
                        v16 s = load(sv + j * MAX_ROWS);
                        s = (key <= hv) & (key >= lv) ? s : splat(-INFINITY);
                        store(sv + j * MAX_ROWS, s);
                        mx = vmax(mx, s);
                    }
                } else {
                    for (int j = 0; j < keys; ++j) mx = vmax(mx, load(sv + j * MAX_ROWS));
                }
                const v16 m_old = load(m + v * LANES);
                const v16 m_new = vmax(m_old, mx);
                // rows that have seen no visible key yet keep m = -inf, l = 0, o = 0
                const v16 shift = m_new == splat(-INFINITY) ? splat(0.f) : m_new;
                const v16 a = m_old == splat(-INFINITY) ? splat(0.f) : vexp(m_old - shift);
                v16 sum = v16{};
                for (int j = 0; j < keys; ++j) {
                    const v16 s = load(sv + j * MAX_ROWS);
                    v16 p = vexp(s - shift);
                    if (masked) p = s == splat(-INFINITY) ? splat(0.f) : p;
                    store(sv + j * MAX_ROWS, p);
                    sum += p;
                }
                store(l + v * LANES, load(l + v * LANES) * a + sum);
                store(m + v * LANES, m_new);
                store(alpha + v * LANES, a);
            }
        }
        if (j0 > key_begin) {
            for (int64_t r = 0; r < u.rows; ++r) {
                const float a = alpha[r];
                for (int d = 0; d < hd; ++d) o[r * hd + d] *= a;
            }
        }
        if (few) {
#if defined(__AVX512F__)
            switch (hd / LANES) {
                case 1: value_rows<1>(vrow, vscale, keys, sc, (int)u.rows, o, hd, ahead); break;
                case 2: value_rows<2>(vrow, vscale, keys, sc, (int)u.rows, o, hd, ahead); break;
                case 4: value_rows<4>(vrow, vscale, keys, sc, (int)u.rows, o, hd, ahead); break;
                case 8: value_rows<8>(vrow, vscale, keys, sc, (int)u.rows, o, hd, ahead); break;
                default: value_rows<16>(vrow, vscale, keys, sc, (int)u.rows, o, hd, ahead); break;
            }
            ahead.rest();
#endif
        } else {
            switch (hd / LANES) {
                case 1: value_chunk<1>(vrow, vscale, keys, st, (int)u.rows, o, hd); break;
                case 2: value_chunk<2>(vrow, vscale, keys, st, (int)u.rows, o, hd); break;
                case 4: value_chunk<4>(vrow, vscale, keys, st, (int)u.rows, o, hd); break;
                case 8: value_chunk<8>(vrow, vscale, keys, st, (int)u.rows, o, hd); break;
                default: value_chunk<16>(vrow, vscale, keys, st, (int)u.rows, o, hd); break;
            }
        }
    }
}

float* out_row(const Problem& pb, const Unit& u, int64_t r) {
    const int64_t group = pb.heads / pb.kv_heads, row = u.row0 + r;
    const int64_t token = pb.seq_info[4 * u.seq] + row / group;
    return pb.out + (token * pb.heads + u.head * group + row % group) * pb.hd;
}

template <typename T>
int attend(const Problem& pb, int64_t num_seqs, int64_t num_threads) {
    const int64_t heads = pb.heads, kv_heads = pb.kv_heads, head_dim = pb.hd, window = pb.window;
    const int64_t* seq_info = pb.seq_info;
    const int64_t* positions = pb.positions;
    const int64_t hv = head_dim / LANES;
    const bool vectors_taken = hv == 1 || hv == 2 || hv == 4 || hv == 8 || hv == 16;  // head_dim 16 .. 256
    if (head_dim % LANES || !vectors_taken || kv_heads < 1 || heads % kv_heads || pb.block_size < 1 || num_threads < 1)
        return -1;
    if (Format<T>::scaled && (pb.k_scales == nullptr || pb.v_scales == nullptr)) return -1;
    const int64_t group = heads / kv_heads;

    std::vector<Unit> units;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t* info = seq_info + 4 * s;
        const int64_t rows = (info[1] - info[0]) * group;
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
                const int64_t n = std::min<int64_t>(MAX_ROWS, rows - r0);
                int64_t first = INT64_MAX, last = 0;
                for (int64_t t = info[0] + r0 / group; t <= info[0] + (r0 + n - 1) / group; ++t) {
                    first = std::min(first, positions[t]);
                    last = std::max(last, positions[t]);
                }
                // A window's first key rounded down to a whole chunk: chunks then start at multiples of CHUNK
                // for every unit, so a decode unit and a prefill's chunk a row's keys alike (the keys before its
                // window are masked: they add exact zeros), and the row's sums are the same.
                const int64_t begin = window > 0 ? std::max<int64_t>(0, first - window + 1) / CHUNK * CHUNK : 0;
                const int64_t end = std::min(last + 1, info[2]);
                units.push_back({s, h, r0, n, begin, std::max(begin, end), 0, 0});
            }
    }
    // Few units (a warm request's new tokens, a small decode batch): split their keys so that every thread
    // has several tasks.
    const int64_t wanted = (4 * num_threads + (int64_t)units.size() - 1) / std::max<int64_t>(1, units.size());
    std::vector<Task> tasks;
    for (size_t i = 0; i < units.size(); ++i) {
        Unit& u = units[i];
        const int64_t keys = u.key_end - u.key_begin;
        int64_t splits = std::max<int64_t>(1, std::min(wanted, keys / MIN_SPLIT_KEYS));
        int64_t step = (keys + splits - 1) / splits;
        step = std::max<int64_t>(CHUNK, (step + CHUNK - 1) / CHUNK * CHUNK);
        u.first_task = tasks.size();
        for (int64_t k = u.key_begin; k < u.key_end || k == u.key_begin; k += step)
            tasks.push_back({(int64_t)i, k, std::min(k + step, u.key_end)});
        u.num_tasks = tasks.size() - u.first_task;
    }
    const int64_t num_tasks = tasks.size();
    // Partial results only for split units; a unit computed by one task writes its rows directly.
    std::vector<int64_t> partial_slot(num_tasks, -1);
    int64_t num_partials = 0;
    for (int64_t t = 0; t < num_tasks; ++t)
        if (units[tasks[t].unit].num_tasks > 1) partial_slot[t] = num_partials++;
    std::vector<float> part_o(num_partials * PAD_ROWS * head_dim), part_m(num_partials * MAX_ROWS),
        part_l(num_partials * MAX_ROWS);
    // The tasks above are planned for num_threads whatever runs them (the plan decides the sums, so the result
    // does not depend on how busy the CPU is); a problem as small as a short decode step runs them on the
    // calling thread, where handing them to another thread and waiting for it cost more than the work
    // (BENCHMARKS.md, "Decode: where a step's time goes").
    int64_t row_keys = 0;
    for (const Unit& u : units) row_keys += u.rows * (u.key_end - u.key_begin);
    const int run_threads = row_keys < SERIAL_ROW_KEYS ? 1 : (int)num_threads;

    // Shared tasks, not an OpenMP team: a team's barrier waits for a helper the scheduler has not run, which on
    // a busy CPU made one call many times slower than one thread alone (cpu_tasks.h says more).
    // A thread takes consecutive tasks a few at a time (a job) when there are many: a sequence's KV heads one
    // after another, each asking for the next one's first chunk while it computes its last (8 decode streams
    // 100 keys in spent most of their attention waiting on each unit's first rows).
    // Only decode-sized units: a prefill's units differ in cost (a causal row sees the keys before it), and
    // jobs of consecutive ones balanced worse than single tasks (2,048-token prefill ~5% slower).
    bool few_rows = KEYS_AS_LANES;
    for (const Unit& u : units) few_rows = few_rows && u.rows <= LANES;
    const int64_t per_job = few_rows ? std::max<int64_t>(1, num_tasks / (4 * num_threads)) : 1;
    const int64_t num_jobs = (num_tasks + per_job - 1) / per_job;
    auto compute = [&](int64_t job) {
        thread_local std::vector<float> own_o;
        if (own_o.size() < (size_t)(PAD_ROWS * head_dim)) own_o.resize(PAD_ROWS * head_dim);
        alignas(64) float own_m[MAX_ROWS], own_l[MAX_ROWS];
        const int64_t first = job * per_job, last = std::min(num_tasks, first + per_job);
        for (int64_t t = first; t < last; ++t) {
            const Task& task = tasks[t];
            const Unit& u = units[task.unit];
            const int64_t slot = partial_slot[t];
            float* o = slot < 0 ? own_o.data() : part_o.data() + slot * PAD_ROWS * head_dim;
            float* m = slot < 0 ? own_m : part_m.data() + slot * MAX_ROWS;
            float* l = slot < 0 ? own_l : part_l.data() + slot * MAX_ROWS;
            const Task* then = t + 1 < last ? &tasks[t + 1] : nullptr;
            run_task<T>(pb, u, task.key_begin, task.key_end, o, m, l, then ? &units[then->unit] : nullptr,
                        then ? then->key_begin : 0, then ? then->key_end : 0, t > first);
            if (slot >= 0) continue;
            for (int64_t r = 0; r < u.rows; ++r) {
                float* dst = out_row(pb, u, r);
                const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
                for (int64_t d = 0; d < head_dim; ++d) dst[d] = o[r * head_dim + d] * inv;
            }
        }
    };
    kv::share_tasks(num_jobs, run_threads, compute);
    auto merge = [&](int64_t i) {
        const Unit& u = units[i];
        if (u.num_tasks < 2) return;
        for (int64_t r = 0; r < u.rows; ++r) {
            float top = -INFINITY;
            for (int64_t t = u.first_task; t < u.first_task + u.num_tasks; ++t)
                top = std::max(top, part_m[partial_slot[t] * MAX_ROWS + r]);
            float* dst = out_row(pb, u, r);
            std::fill(dst, dst + head_dim, 0.f);
            float total = 0.f;
            for (int64_t t = u.first_task; t < u.first_task + u.num_tasks; ++t) {
                const int64_t slot = partial_slot[t];
                const float mt = part_m[slot * MAX_ROWS + r];
                if (mt == -INFINITY) continue;
                const float w = std::exp(mt - top);
                total += w * part_l[slot * MAX_ROWS + r];
                const float* src = part_o.data() + (slot * PAD_ROWS + r) * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) dst[d] += w * src[d];
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] *= inv;
        }
    };
    // (no unit split: every row is written already, and handing out a job that does nothing costs a round
    // trip with the helpers, ~30 a decode step)
    if (num_partials > 0) kv::share_tasks((int64_t)units.size(), run_threads, merge);
    return 0;
}

}  // namespace

// Returns 0, or -1 for a shape this kernel does not take (the caller then uses another path).
extern "C" int kv_paged_attention_f32(
    const float* q, int64_t q_token_stride, float* out, const float* k_pool, const float* v_pool,
    int64_t num_seqs, const int64_t* seq_info, const int64_t* block_tables, const int64_t* positions,
    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    int64_t num_threads) {
    const Problem pb{q, q_token_stride, out, k_pool, v_pool, nullptr, nullptr, seq_info, block_tables, positions,
                     heads, kv_heads, head_dim, block_size, window, scale};
    return attend<float>(pb, num_seqs, num_threads);
}

// The same over a pool stored in another format: 0 fp32, 1 fp16, 2 bf16, 3 fp8 e4m3 (k_scales, v_scales:
// [blocks][kv_heads]), 4 int8 ([slots][kv_heads]); value = stored * scale. -1: a format or shape it does not
// take.
extern "C" int kv_paged_attention(
    const float* q, int64_t q_token_stride, float* out, const void* k_pool, const void* v_pool,
    const float* k_scales, const float* v_scales, int64_t format,
    int64_t num_seqs, const int64_t* seq_info, const int64_t* block_tables, const int64_t* positions,
    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window, float scale,
    int64_t num_threads) {
    const Problem pb{q, q_token_stride, out, k_pool, v_pool, k_scales, v_scales, seq_info, block_tables,
                     positions, heads, kv_heads, head_dim, block_size, window, scale};
    switch (format) {
        case 0: return attend<float>(pb, num_seqs, num_threads);
        case 1: return attend<Half>(pb, num_seqs, num_threads);
        case 2: return attend<BFloat>(pb, num_seqs, num_threads);
        case 3: return attend<Fp8>(pb, num_seqs, num_threads);
        case 4: return attend<int8_t>(pb, num_seqs, num_threads);
        default: return -1;
    }
}
