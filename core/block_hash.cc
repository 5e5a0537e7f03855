#include "core/block_hash.h"

#include "absl/strings/str_format.h"

namespace kvstep {
namespace {

// splitmix64's finalizer: a full-avalanche 64-bit mix.
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

struct Lane {
  uint64_t h;
  void Add(uint64_t v) { h = Mix(h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6))); }
};

}  // namespace

std::string BlockHash::ToHex() const {
  return absl::StrFormat("%016x%016x", hi, lo);
}

BlockHash HashBlock(const std::optional<BlockHash>& parent,
                    absl::Span<const int64_t> tokens, absl::string_view extra) {
  Lane a{0x6b7673746570ULL};    // "kvstep"
  Lane b{0x70726566697863ULL};  // "prefixc"
  const uint64_t has_parent = parent.has_value() ? 1 : 0;
  a.Add(has_parent);
  b.Add(has_parent ^ 0x5555);
  if (parent) {
    a.Add(parent->hi);
    a.Add(parent->lo);
    b.Add(parent->lo);
    b.Add(parent->hi);
  }
  a.Add(tokens.size());
  b.Add(~static_cast<uint64_t>(tokens.size()));
  for (int64_t t : tokens) {
    a.Add(static_cast<uint64_t>(t));
    b.Add(static_cast<uint64_t>(t) * 0xff51afd7ed558ccdULL);
  }
  a.Add(extra.size());
  b.Add(extra.size() ^ 0xaaaa);
  for (unsigned char c : extra) {
    a.Add(c);
    b.Add(c ^ 0x5a);
  }
  return BlockHash{a.h, b.h};
}

}  // namespace kvstep
