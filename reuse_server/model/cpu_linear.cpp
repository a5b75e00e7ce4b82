// y = x W^T + b on the CPU, fp32, W packed once into panels of 64 output columns: panel p holds
// W[64p:64p+64, :] transposed, [K][64], zero-padded past the last column. A tile of up to 6 rows of x
// against one panel keeps 6 x 4 vector accumulators in registers; each step over K loads one row of the
// panel (4 vectors) and broadcasts 6 elements of x. Tiles are spread over the threads panel-major, so a
// thread reuses its panel from cache across all row tiles (a few rows: taken by whichever thread is running). oneDNN's reordered-weight matmul, the
// alternative, spends ~40% longer on the few-row products of decode steps and warm requests here.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "cpu_kernels.h"
#include "cpu_tasks.h"
#include "cpu_vector.h"

namespace {

using namespace kv;

constexpr int PANEL = 64;
static_assert(PANEL == 64, "panel_fma (cpu_vector.h) runs panels of 64 columns");
constexpr int TILE_ROWS = 6;
// Up to this many rows (decode steps, as cpu_quant.cpp's direct path) a call's tiles are shared by the calling
// thread and the helpers that are running (cpu_tasks.h) rather than handed to an OpenMP team.
constexpr int64_t FEW_ROWS = 24;

template <int RT>
void tile(const float* x, int64_t ldx, const float* panel, const float* bias, int64_t k, float* y, int64_t ldy,
          int cols) {
    v16 acc[RT][4];
    for (int h = 0; h < 4; ++h) {
        const v16 b = bias ? load(bias + 16 * h) : v16{};
        for (int i = 0; i < RT; ++i) acc[i][h] = b;
    }
    panel_fma<RT>(acc, x, ldx, panel, k);
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

}  // namespace

// x: [m, k] with row stride ldx; panels: [ceil(n / 64)][k][64]; bias: [ceil(n / 64) * 64] or null;
// y: [m, n] contiguous.
extern "C" void kv_linear_f32(const float* x, int64_t m, int64_t ldx, int64_t k, const float* panels,
                              const float* bias, int64_t n, float* y, int64_t num_threads) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    const int64_t row_tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    const auto task = [&](int64_t p, int64_t r) {
        const int64_t r0 = r * TILE_ROWS;
        const int rows = (int)std::min<int64_t>(TILE_ROWS, m - r0);
        const int cols = (int)std::min<int64_t>(PANEL, n - p * PANEL);
        const float* xr = x + r0 * ldx;
        const float* panel = panels + p * k * PANEL;
        const float* b = bias ? bias + p * PANEL : nullptr;
        float* yr = y + r0 * n + p * PANEL;
        switch (rows) {
            case 6: tile<6>(xr, ldx, panel, b, k, yr, n, cols); break;
            case 5: tile<5>(xr, ldx, panel, b, k, yr, n, cols); break;
            case 4: tile<4>(xr, ldx, panel, b, k, yr, n, cols); break;
            case 3: tile<3>(xr, ldx, panel, b, k, yr, n, cols); break;
            case 2: tile<2>(xr, ldx, panel, b, k, yr, n, cols); break;
            default: tile<1>(xr, ldx, panel, b, k, yr, n, cols); break;
        }
    };
    if (m <= FEW_ROWS) {  // decode: shared without OpenMP's barrier (cpu_tasks.h)
        auto body = [&](int64_t t) { task(t / row_tiles, t % row_tiles); };
        share_tasks(num_panels * row_tiles, (int)num_threads, body);
        return;
    }
#pragma omp parallel for collapse(2) schedule(static) num_threads((int)num_threads)
    for (int64_t p = 0; p < num_panels; ++p) {
        for (int64_t r = 0; r < row_tiles; ++r) task(p, r);
    }
}
