// The CPU's fp32 FMA ceiling: each thread, pinned to its own CPU, runs 12 independent chains of 16-lane FMAs
// (enough to cover the FMA latency on two pipes) and prints how many it issued a second. bench_decode runs it
// beside the decode figures, as it measures the memory read bandwidth: the two ceilings a step meets.
// Built with the host's own instruction set (g++ -O2 -march=native).
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

// 16 fp32 lanes as gcc's vector extension: -march=native makes a * b + c one AVX-512 FMA (two with AVX2).
typedef float vec __attribute__((vector_size(64)));
constexpr int LANES = 16;

float chains(long iters) {
    vec a[12];
    for (int i = 0; i < 12; ++i) a[i] = vec{} + (1.0f + i * 1e-3f);
    const vec b = vec{} + 0.999999f, c = vec{} + 1e-7f;
    for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = a[i] * b + c;
    }
    float s = 0;
    for (int i = 0; i < 12; ++i) s += a[i][0];
    return s;
}

int main(int argc, char** argv) {
    const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
    const long iters = argc > 2 ? std::atol(argv[2]) : 100000000;
    std::vector<double> rate(threads);
    std::vector<float> sink(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
        pool.emplace_back([&, t] {
            cpu_set_t set;
            CPU_ZERO(&set);
            CPU_SET(t, &set);
            pthread_setaffinity_np(pthread_self(), sizeof set, &set);
            const auto start = std::chrono::steady_clock::now();
            sink[t] = chains(iters);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            rate[t] = 12.0 * iters / s;
        });
    for (auto& t : pool) t.join();
    for (int t = 0; t < threads; ++t) std::printf("%d %d %.6e %g\n", t, LANES, rate[t], sink[t]);
    return 0;
}
