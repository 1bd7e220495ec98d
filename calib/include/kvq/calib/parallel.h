// A minimal work pool for calibration, evaluation, the model forward and kvq ppl: items
// [0, count) on `threads` threads, the first exception rethrown after every worker has
// stopped. Which thread runs which item never changes a result: callers give each item its
// own outputs.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq::calib {

// The caller's thread is one of the workers.
inline void ParallelItems(int count, int threads, const std::function<void(int)>& work) {
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::exception_ptr error;
  auto worker = [&]() {
    for (int i = next++; i < count && !failed; i = next++) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  const int pool_size = std::max(1, std::min(threads, count));
  std::vector<std::thread> pool;
  for (int t = 1; t < pool_size; ++t) pool.emplace_back(worker);
  worker();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// The same with progress: the caller's thread only waits, and calls on_done() once per finished
// item (never concurrently, none after a failure) while the workers go on.
inline void ParallelItems(int count, int threads, const std::function<void(int)>& work,
                          const std::function<void()>& on_done) {
  if (!on_done) return ParallelItems(count, threads, work);
  std::atomic<int> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable changed;
  int finished = 0;
  int reported = 0;
  int running = 0;
  std::exception_ptr error;
  auto worker = [&]() {
    for (int i = next++; i < count && !failed; i = next++) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        failed = true;
      }
      std::lock_guard<std::mutex> lock(mutex);
      ++finished;
      changed.notify_all();
    }
    std::lock_guard<std::mutex> lock(mutex);
    --running;
    changed.notify_all();
  };
  const int pool_size = std::max(1, std::min(threads, count));
  running = pool_size;
  std::vector<std::thread> pool;
  for (int t = 0; t < pool_size; ++t) pool.emplace_back(worker);
  {
    std::unique_lock<std::mutex> lock(mutex);
    while (running > 0) {
      changed.wait(lock, [&] { return finished > reported || running == 0; });
      while (reported < finished) {
        ++reported;
        lock.unlock();
        if (!failed) on_done();
        lock.lock();
      }
    }
  }
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace kvq::calib
