// A minimal work pool for the model forward and kvq ppl: items [0, count) on `threads`
// threads (the caller's thread is one of them), the first exception rethrown after every
// worker has stopped. Which thread runs which item never changes a result: callers give
// each item its own outputs.
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq::calib {

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

}  // namespace kvq::calib
