// Writes the small valid seed files of fuzz/corpus/{npy,safetensors}/ (each < 4 KB).
// Usage: kvq_make_seed_corpus OUT_DIR   (writes OUT_DIR/npy/* and OUT_DIR/safetensors/*)
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "kvq/common/error.h"
#include "kvq/common/io.h"
#include "kvq/common/tensor.h"

namespace {

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

// A header the way NumPy >= 1.24 pads it (growth spaces, 64-byte alignment), version `major`.
std::vector<uint8_t> NumpyStyle(int major, const std::string& dict, const std::string& data) {
  const size_t prefix = major == 1 ? 10 : 12;
  std::string header = dict + std::string(20, ' ');
  header.append(64 - (prefix + header.size() + 1) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY", 6);
  out += static_cast<char>(major);
  out += '\0';
  for (size_t i = 0; i < prefix - 8; ++i)
    out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return Bytes(out + header + data);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_DIR\n", argv[0]);
    return 1;
  }
  const std::string out = argv[1];
  try {
    using kvq::Tensor;
    kvq::WriteNpy(out + "/npy/f32_2x3.npy", Tensor::F32({2, 3}, {1, -2, 3.5f, 0, -0.0f, 1e-40f}));
    kvq::WriteNpy(out + "/npy/f16_4.npy", Tensor::F16({4}, {0x3c00, 0x7bff, 0x0001, 0xfc00}));
    kvq::WriteNpy(out + "/npy/u8_scalar.npy", Tensor::U8({}, {7}));
    kvq::WriteNpy(out + "/npy/i32_0x3.npy", Tensor::I32({0, 3}, {}));
    kvq::WriteNpy(out + "/npy/i32_2x1x2.npy", Tensor::I32({2, 1, 2}, {-1, 0, 1, 2147483647}));
    kvq::WriteFile(
        out + "/npy/numpy_v1_u8.npy",
        NumpyStyle(1, "{'descr': '|u1', 'fortran_order': False, 'shape': (3,), }", "abc"));
    kvq::WriteFile(
        out + "/npy/numpy_v2_f32.npy",
        NumpyStyle(2, "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 1), }",
                   std::string("\x00\x00\x80\x3f", 4)));
    kvq::WriteFile(out + "/npy/numpy_v3_f16.npy",
                         NumpyStyle(3, "{'descr': '<f2', 'fortran_order': False, 'shape': (), }",
                                    std::string("\x00\x3c", 2)));

    kvq::Safetensors all;
    all.metadata = {{"format", "kvq-quantized"}, {"head_dim", "64"}};
    all.Add("f32", Tensor::F32({2, 2}, {1, 2, 3, 4}));
    all.Add("f16", Tensor::F16({3}, {0x3c00, 0x0000, 0x8001}));
    all.Add("bf16", Tensor::BF16({2}, {0x3f80, 0xff80}));
    all.Add("u8", Tensor::U8({4}, {0, 1, 2, 3}));
    all.Add("i32", Tensor::I32({1}, {-7}));
    all.Add("empty", Tensor::U8({0, 5}, {}));
    kvq::WriteSafetensors(out + "/safetensors/all_dtypes.safetensors", all);
    kvq::WriteSafetensors(out + "/safetensors/empty.safetensors", kvq::Safetensors{});
    kvq::Safetensors metadata_only;
    metadata_only.metadata = {{"k", "v"}, {"unicode", "\xc3\xa9"}};
    kvq::WriteSafetensors(out + "/safetensors/metadata_only.safetensors", metadata_only);
    // Header keys out of data order, fields reordered, padded with spaces: a valid file that
    // our writer would lay out differently.
    const std::string header =
        "{\"y\":{\"shape\":[2],\"dtype\":\"U8\",\"data_offsets\":[1,3]},"
        "\"x\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[1,1]},"
        "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}  ";
    std::string file;
    for (int i = 0; i < 8; ++i) file += static_cast<char>((header.size() >> (8 * i)) & 0xff);
    kvq::WriteFile(out + "/safetensors/reordered.safetensors", Bytes(file + header + "abc"));
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq_make_seed_corpus: %s\n", e.what());
    return 1;
  }
  return 0;
}
