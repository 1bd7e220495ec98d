// SHA-256 against the FIPS 180-2 appendix B test vectors, and incremental hashing against
// one-shot hashing over every split point.
#include "kvq/conformance/sha256.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/common/error.h"

namespace kvq::conformance {
namespace {

std::string HashOf(const std::string& text) {
  return Sha256Hex(reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

TEST(ConformanceSha256, Fips180OneBlockMessageAbc) {
  EXPECT_EQ(HashOf("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ConformanceSha256, EmptyMessage) {
  EXPECT_EQ(HashOf(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Sha256Hex(nullptr, 0), HashOf(""));
}

TEST(ConformanceSha256, Fips180MultiBlockMessage448Bits) {
  const std::string message = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  ASSERT_EQ(message.size() * 8, 448u);
  EXPECT_EQ(HashOf(message), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(ConformanceSha256, Fips180LongMessageMillionA) {
  Sha256 hasher;
  const std::string chunk(1000, 'a');
  for (int i = 0; i < 1000; ++i) {
    hasher.Update(reinterpret_cast<const uint8_t*>(chunk.data()), chunk.size());
  }
  const auto digest = hasher.Final();
  EXPECT_EQ(HexString(digest.data(), digest.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(ConformanceSha256, IncrementalEqualsOneShotAtEverySplit) {
  // Lengths around the 55/56/64-byte padding boundaries, split at every point.
  for (size_t length : {0u, 1u, 55u, 56u, 63u, 64u, 65u, 119u, 120u, 128u, 200u}) {
    std::vector<uint8_t> data(length);
    for (size_t i = 0; i < length; ++i) data[i] = static_cast<uint8_t>(i * 37 + 11);
    const std::string expected = Sha256Hex(data);
    for (size_t split = 0; split <= length; ++split) {
      Sha256 hasher;
      hasher.Update(data.data(), split);
      hasher.Update(data.data() + split, length - split);
      const auto digest = hasher.Final();
      ASSERT_EQ(HexString(digest.data(), digest.size()), expected)
          << "length " << length << ", split " << split;
    }
  }
}

TEST(ConformanceSha256, RejectsUseAfterFinal) {
  Sha256 hasher;
  hasher.Final();
  const uint8_t byte = 0;
  EXPECT_THROW(hasher.Update(&byte, 1), Error);
  EXPECT_THROW(hasher.Final(), Error);
}

}  // namespace
}  // namespace kvq::conformance
