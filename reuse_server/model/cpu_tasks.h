// Tasks shared between the calling thread and helper threads that join only if they are running: for the
// short parallel loops of a decode step (a one-row product is 2 to 300 us), where an OpenMP region's cost is
// its hand-off. An OpenMP region (static or dynamic) ends at a barrier that waits for every thread of the team,
// so on a busy CPU a helper that is not running when the region starts (asleep after its spin, or preempted)
// holds the caller until the scheduler gives it a core: measured on this project's shared 2-core VM, the
// model's 121 one-row products took 24 ms on 2 OpenMP threads and 12 ms on 1 (BENCHMARKS.md, "Decode: where a
// step's time goes"). Here the caller takes tasks from a shared counter and never waits for a helper that has
// not taken one: it waits only for the tasks a helper is running. Helpers spin a short while after a job, then
// sleep until the next one.
//
// Which thread runs a task never changes what the task computes (each writes its own outputs, in a fixed
// order of sums), so results are the same as on one thread. One caller at a time: a second concurrent caller
// (another Python thread: ctypes releases the GIL) runs its tasks alone on its own thread; so does a forked
// child, whose helpers did not survive the fork.
#pragma once

#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace kv {

class TaskPool {
  public:
    using Fn = void (*)(void* ctx, int64_t task);

    // fn(ctx, i) for i in [0, total), on the calling thread and up to threads - 1 helpers.
    void run(int64_t total, int threads, Fn fn, void* ctx) {
        if (total <= 0) return;
        if (threads <= 1 || total == 1 || getpid() != pid_ || !caller_.try_lock()) {
            for (int64_t i = 0; i < total; ++i) fn(ctx, i);
            return;
        }
        const int helpers = std::min(threads - 1, MAX_HELPERS);
        while (started_ < helpers) {
            std::thread(&TaskPool::helper, this, started_).detach();
            ++started_;
        }
        // Publish the job as a seqlock: an odd generation while its description is written, then even.
        const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;  // odd
        state_.store(gen << 32, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_release);
        fn_.store(fn, std::memory_order_relaxed);
        ctx_.store(ctx, std::memory_order_relaxed);
        total_.store(total, std::memory_order_relaxed);
        helpers_.store(helpers, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        state_.store((gen + 1) << 32, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(mutex_); }
            wake_.notify_all();
        }
        int64_t mine = 0;
        for (;;) {
            const int64_t i = (int64_t)(state_.fetch_add(1, std::memory_order_acq_rel) & INDEX);
            if (i >= total) break;
            fn(ctx, i);
            ++mine;
        }
        // Only the tasks a helper took are left: wait for them, giving the core up now and then in case the
        // helper that runs one shares it.
        const int64_t others = total - mine;
        for (int spins = 0; done_.load(std::memory_order_acquire) < others; ++spins) {
            _mm_pause();
            if ((spins & 1023) == 1023) sched_yield();
        }
        caller_.unlock();
    }

    static TaskPool& instance() {
        static TaskPool* pool = new TaskPool();  // never destroyed: its helpers are detached and outlive main()
        return *pool;
    }

  private:
    static constexpr int MAX_HELPERS = 63;
    static constexpr uint64_t INDEX = 0xffffffffu;
    // How long an idle helper spins before it sleeps: back-to-back products of a decode step are a few to a
    // few tens of microseconds apart.
    static constexpr auto SPIN = std::chrono::microseconds(100);

    void helper(int index) {
        uint64_t seen = 0;
        for (;;) {
            uint64_t s = state_.load(std::memory_order_acquire);
            uint64_t gen = s >> 32;
            if ((gen & 1) || gen == seen) {
                idle(seen);
                continue;
            }
            const Fn fn = fn_.load(std::memory_order_relaxed);
            void* const ctx = ctx_.load(std::memory_order_relaxed);
            const int64_t total = total_.load(std::memory_order_relaxed);
            const int helpers = helpers_.load(std::memory_order_relaxed);
            std::atomic_thread_fence(std::memory_order_acquire);
            s = state_.load(std::memory_order_relaxed);
            if ((s >> 32) != gen) continue;  // a newer job was being written meanwhile
            seen = gen;
            if (index >= helpers) continue;
            // Take tasks while the job is this one and has any left; a task taken is one the caller waits for.
            for (;;) {
                if ((s >> 32) != gen || (int64_t)(s & INDEX) >= total) break;
                if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_relaxed))
                    continue;
                fn(ctx, (int64_t)(s & INDEX));
                done_.fetch_add(1, std::memory_order_release);
                s = state_.load(std::memory_order_relaxed);
            }
        }
    }

    // Wait for a job newer than `seen`: spin a little, then sleep.
    void idle(uint64_t seen) {
        const auto fresh = [&] {
            const uint64_t gen = state_.load(std::memory_order_seq_cst) >> 32;
            return !(gen & 1) && gen != seen;
        };
        const auto until = std::chrono::steady_clock::now() + SPIN;
        do {
            for (int i = 0; i < 64; ++i) {
                if (fresh()) return;
                _mm_pause();
            }
        } while (std::chrono::steady_clock::now() < until);
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, fresh);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }

    const pid_t pid_ = getpid();
    std::mutex caller_;
    int started_ = 0;  // written under caller_
    alignas(64) std::atomic<uint64_t> state_{0};  // generation << 32 | next task
    alignas(64) std::atomic<int64_t> done_{0};    // tasks helpers finished
    alignas(64) std::atomic<Fn> fn_{nullptr};
    std::atomic<void*> ctx_{nullptr};
    std::atomic<int64_t> total_{0};
    std::atomic<int> helpers_{0};
    std::atomic<int> sleepers_{0};
    std::mutex mutex_;
    std::condition_variable wake_;
};

// body(i) for i in [0, total), shared as TaskPool::run shares them.
template <class Body>
inline void share_tasks(int64_t total, int threads, Body& body) {
    TaskPool::instance().run(total, threads, [](void* ctx, int64_t i) { (*static_cast<Body*>(ctx))(i); }, &body);
}

}  // namespace kv
