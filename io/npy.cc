// .npy reading and writing (Note [npy dtypes] in io/npy.h).
#include "io/npy.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include "base/check.h"
#include "base/error.h"

namespace porter::io {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

[[noreturn]] void fail(const std::string& what, size_t offset, const std::string& msg) {
  throw IoError(what + ": malformed .npy at byte offset " + std::to_string(offset) + ": " + msg);
}

// A tiny cursor over the header's Python dict literal, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class HeaderParser {
 public:
  HeaderParser(const std::string& text, size_t base, const std::string& what)
      : s_(text), base_(base), what_(what) {}

  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n')) ++i_;
  }
  bool peek(char c) {
    skip_ws();
    return i_ < s_.size() && s_[i_] == c;
  }
  void expect(char c) {
    if (!peek(c)) error(std::string("expected '") + c + "'");
    ++i_;
  }
  std::string string_lit() {
    skip_ws();
    if (i_ >= s_.size() || (s_[i_] != '\'' && s_[i_] != '"')) error("expected a quoted string");
    char q = s_[i_++];
    size_t start = i_;
    while (i_ < s_.size() && s_[i_] != q) ++i_;
    if (i_ >= s_.size()) error("unterminated string");
    return s_.substr(start, i_++ - start);
  }
  bool bool_lit() {
    skip_ws();
    if (s_.compare(i_, 4, "True") == 0) { i_ += 4; return true; }
    if (s_.compare(i_, 5, "False") == 0) { i_ += 5; return false; }
    error("expected True or False");
  }
  std::vector<int64_t> tuple_lit() {
    expect('(');
    std::vector<int64_t> dims;
    while (!peek(')')) {
      skip_ws();
      size_t start = i_;
      int64_t v = 0;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
        if (v > (int64_t{1} << 50)) error("dimension too large");
        v = v * 10 + (s_[i_++] - '0');
      }
      if (i_ == start) error("expected a non-negative integer dimension");
      dims.push_back(v);
      if (!peek(',')) break;
      ++i_;
    }
    expect(')');
    return dims;
  }
  [[noreturn]] void error(const std::string& msg) const {
    fail(what_, base_ + i_, msg + " in header \"" + s_ + "\"");
  }

 private:
  const std::string& s_;
  size_t base_;
  const std::string& what_;
  size_t i_ = 0;
};

size_t itemsize(tensor::DType t) { return tensor::dtype_size(t); }

std::string descr_of(tensor::DType t) {
  switch (t) {
    case tensor::DType::kF32: return "<f4";
    case tensor::DType::kI32: return "<i4";
    case tensor::DType::kI64: return "<i8";
    case tensor::DType::kBool: return "|b1";
    case tensor::DType::kBF16: return "<u2";
    case tensor::DType::kF16: return "<f2";
  }
  return "?";
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

NpyArray parse_npy(const std::byte* bytes, size_t size, const std::string& what) {
  if (size < kMagicLen + 4) fail(what, 0, "file is " + std::to_string(size) + " bytes, shorter than the .npy preamble");
  if (std::memcmp(bytes, kMagic, kMagicLen) != 0) fail(what, 0, "missing the \\x93NUMPY magic");
  const auto major = static_cast<uint8_t>(bytes[6]);
  size_t header_len = 0, header_start = 0;
  if (major == 1) {
    header_len = static_cast<size_t>(bytes[8]) | (static_cast<size_t>(bytes[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail(what, 8, "truncated version-2 header length");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<size_t>(bytes[8 + i]) << (8 * i);
    header_start = 12;
  } else {
    fail(what, 6, "unsupported .npy version " + std::to_string(major) + " (1, 2 and 3 are read)");
  }
  if (header_start + header_len > size) {
    fail(what, header_start, "header of " + std::to_string(header_len) +
                                 " bytes runs past the end of the file (" + std::to_string(size) +
                                 " bytes)");
  }
  std::string header(reinterpret_cast<const char*>(bytes + header_start), header_len);
  HeaderParser p(header, header_start, what);
  std::string descr;
  bool fortran = false, have_descr = false, have_shape = false;
  NpyArray out;
  p.expect('{');
  while (!p.peek('}')) {
    std::string key = p.string_lit();
    p.expect(':');
    if (key == "descr") {
      descr = p.string_lit();
      have_descr = true;
    } else if (key == "fortran_order") {
      fortran = p.bool_lit();
    } else if (key == "shape") {
      out.shape = p.tuple_lit();
      have_shape = true;
    } else {
      p.error("unknown key '" + key + "'");
    }
    if (!p.peek(',')) break;
    p.expect(',');
  }
  p.expect('}');
  if (!have_descr || !have_shape) p.error("header lacks 'descr' or 'shape'");
  if (descr == "<f4") out.dtype = tensor::DType::kF32;
  else if (descr == "<i4") out.dtype = tensor::DType::kI32;
  else if (descr == "<u2") out.dtype = tensor::DType::kBF16;
  else
    p.error("dtype '" + descr + "' is not supported (little-endian '<f4', '<i4', '<u2' for bf16)");
  if (fortran && out.shape.size() > 1) p.error("fortran_order arrays are not supported; save C order");
  const size_t data_start = header_start + header_len;
  const size_t expected = static_cast<size_t>(out.numel()) * itemsize(out.dtype);
  if (size - data_start != expected) {
    fail(what, data_start, "data is " + std::to_string(size - data_start) + " bytes, but shape (" +
                               [&] {
                                 std::string s;
                                 for (int64_t d : out.shape) s += std::to_string(d) + ",";
                                 return s;
                               }() + ") of " + descr + " needs " + std::to_string(expected));
  }
  out.data.assign(bytes + data_start, bytes + size);
  return out;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path + ": cannot open .npy file for reading");
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw IoError(path + ": read error");
  return parse_npy(reinterpret_cast<const std::byte*>(raw.data()), raw.size(), path);
}

std::vector<std::byte> encode_npy(const void* data, tensor::DType dtype, const std::vector<int64_t>& shape) {
  PORTER_CHECK(dtype != tensor::DType::kF16, ".npy output of f16 is not supported; cast to f32 first");
  std::string dict = "{'descr': '" + descr_of(dtype) + "', 'fortran_order': False, 'shape': (";
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]) + (shape.size() == 1 || i + 1 < shape.size() ? "," : "");
    if (i + 1 < shape.size()) dict += " ";
    n *= shape[i];
  }
  dict += "), }";
  // Pad with spaces so the data starts at a multiple of 64 bytes, ending the header in '\n'.
  size_t preamble = 10;
  int major = 1;
  if (dict.size() + 1 + preamble > 65535) {
    preamble = 12;
    major = 2;
  }
  size_t total = (preamble + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - preamble - dict.size() - 1, ' ');
  dict += '\n';
  const size_t data_bytes = static_cast<size_t>(n) * itemsize(dtype);
  std::vector<std::byte> out(total + data_bytes);
  std::memcpy(out.data(), kMagic, kMagicLen);
  out[6] = static_cast<std::byte>(major);
  out[7] = std::byte{0};
  const size_t hl = dict.size();
  for (size_t i = 0; i < preamble - 8; ++i) out[8 + i] = static_cast<std::byte>((hl >> (8 * i)) & 0xff);
  std::memcpy(out.data() + preamble, dict.data(), dict.size());
  if (data_bytes > 0) std::memcpy(out.data() + total, data, data_bytes);
  return out;
}

void write_npy(const std::string& path, const void* data, tensor::DType dtype,
               const std::vector<int64_t>& shape) {
  std::vector<std::byte> bytes = encode_npy(data, dtype, shape);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw IoError(path + ": cannot open .npy file for writing");
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) throw IoError(path + ": write failed (disk full?)");
}

std::vector<float> npy_to_f32(const NpyArray& a) {
  const size_t n = static_cast<size_t>(a.numel());
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (a.dtype == tensor::DType::kF32) {
      std::memcpy(&v[i], a.data.data() + 4 * i, 4);
    } else if (a.dtype == tensor::DType::kBF16) {
      uint16_t h;
      std::memcpy(&h, a.data.data() + 2 * i, 2);
      v[i] = tensor::bf16_to_f32(h);
    } else {
      int32_t x;
      std::memcpy(&x, a.data.data() + 4 * i, 4);
      v[i] = static_cast<float>(x);
    }
  }
  return v;
}

void save_tensor_npy(const std::string& path, memory::Device& device, const tensor::Tensor& t,
                     bool bf16_as_f32) {
  const std::vector<int64_t> shape = t.shape().to_vector();
  std::vector<std::byte> raw(t.nbytes());
  if (t.dtype() == tensor::DType::kBF16 && bf16_as_f32) {
    std::vector<float> v = tensor::to_host_f32(device, t);
    write_npy(path, v.data(), tensor::DType::kF32, shape);
    return;
  }
  if (!raw.empty()) device.copy_sync(raw.data(), t.data(), raw.size());
  write_npy(path, raw.data(), t.dtype(), shape);
}

tensor::Tensor load_tensor_npy(const std::string& path, memory::CachingAllocator& allocator, tensor::DType dtype,
                       memory::Category category) {
  NpyArray a = read_npy(path);
  tensor::Tensor t = tensor::Tensor::empty(allocator, tensor::Shape(a.shape), dtype, category);
  if (a.dtype == dtype) {
    if (!a.data.empty()) allocator.device().copy_sync(t.data(), a.data.data(), a.data.size());
    return t;
  }
  if (a.dtype == tensor::DType::kI32 || dtype == tensor::DType::kI32) {
    throw IoError(path + ": holds " + std::string(tensor::dtype_name(a.dtype)) + " values, cannot load as " +
                  std::string(tensor::dtype_name(dtype)));
  }
  tensor::from_host_f32(allocator.device(), npy_to_f32(a), t);
  return t;
}

}  // namespace porter::io
