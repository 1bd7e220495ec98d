// The backend list's CUDA backend in programs that link the CUDA adapter (cuda_source.h).
#include "cuda_source.h"

#ifdef KVQ_HAVE_CUDA
#include "cuda_backend.h"  // gpu/adapter
#endif

namespace kvq {

const cpu::Backend* CudaBackendOrNull(std::string* why_not) {
#ifdef KVQ_HAVE_CUDA
  const cpu::Backend* cuda = gpu::CudaBackend();
  if (cuda == nullptr) *why_not = "no CUDA device is present";
  return cuda;
#else
  *why_not = "this kvq was built without CUDA";
  return nullptr;
#endif
}

}  // namespace kvq
