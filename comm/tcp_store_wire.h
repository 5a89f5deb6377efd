// The wire format of the rendezvous store (Note [TcpStore protocol] in comm/tcp_store.cc):
// frame encoding and decoding, the ops, the limits a server applies to a connection (Note
// [Store authentication]) and the hello that carries the token. Private to comm/tcp_store.cc;
// in a header of its own so that the format reads apart from the server and the client.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "comm/store.h"

namespace porter::comm::tcp_wire {

enum class Op : uint8_t { kSet = 1, kGet = 2, kWait = 3, kAdd = 4, kCheck = 5, kHello = 6 };
constexpr uint8_t kStatusOk = 0;
constexpr uint8_t kStatusError = 1;
constexpr uint32_t kMaxFrameBytes = 1u << 30;  // 1 GiB: larger frames are corrupt streams
// Note [Store authentication]: the largest frame before a hello, and the piece a body is read in.
constexpr uint32_t kMaxHelloBytes = 4096;
constexpr size_t kReadPieceBytes = 64 << 10;

static_assert(8 + 1 + 4 + 4 + kMaxStoreTokenBytes <= kMaxHelloBytes, "a hello must fit");

// --- encoding ----------------------------------------------------------------------------

inline void put_u32(std::vector<char>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_u64(std::vector<char>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline uint64_t load_le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
inline void put_field(std::vector<char>& out, std::string_view bytes) {
  put_u32(out, static_cast<uint32_t>(bytes.size()));
  out.insert(out.end(), bytes.begin(), bytes.end());
}
// Patches the frame's leading length once the body is complete.
inline void finish_frame(std::vector<char>& frame) {
  const auto n = static_cast<uint32_t>(frame.size() - 4);
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xff);
}

// Bounds-checked reading of one frame body; any overrun clears ok.
struct Reader {
  const char* p;
  size_t n;
  bool ok = true;
  uint64_t u(int bytes) {
    if (n < static_cast<size_t>(bytes)) {
      ok = false;
      return 0;
    }
    uint64_t v = load_le(p, bytes);
    p += bytes;
    n -= bytes;
    return v;
  }
  std::string_view field() {
    auto len = static_cast<size_t>(u(4));
    if (!ok || n < len) {
      ok = false;
      return {};
    }
    std::string_view v(p, len);
    p += len;
    n -= len;
    return v;
  }
};

// Whether two tokens are equal, in time that depends only on their lengths: timing the
// server's answer must not tell a guesser how many leading bytes were right.
inline bool same_token(std::string_view expected, std::string_view got) {
  volatile unsigned char diff = expected.size() == got.size() ? 0 : 1;
  for (size_t i = 0; i < expected.size(); ++i) {
    const char g = i < got.size() ? got[i] : '\0';
    diff = diff | static_cast<unsigned char>(expected[i] ^ g);
  }
  return diff == 0;
}

// The hello frame: a request with op kHello and the token as its one field.
inline std::vector<char> hello_frame(uint64_t id, const std::string& token) {
  std::vector<char> frame(4);
  put_u64(frame, id);
  frame.push_back(static_cast<char>(Op::kHello));
  put_u32(frame, 1);
  put_field(frame, token);
  finish_frame(frame);
  return frame;
}

}  // namespace porter::comm::tcp_wire
