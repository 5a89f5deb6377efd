// Safetensors files (Note [Safetensors format] in io/weights_file.h) and flat-buffer splitting.
#include "io/weights_file.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <set>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/units.h"

namespace porter::io {
namespace {

namespace fs = std::filesystem;

// The safetensors library refuses headers above 100 MB; so does porter, before allocating.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";

std::string quoted(const fs::path& p) { return "\"" + p.string() + "\""; }

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

// numel of `shape`, or -1 when a dimension is negative or the product overflows.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

// A non-negative integer (nlohmann stores one read from text as unsigned, one set from an
// int64_t as signed).
template <typename Json>
bool is_count(const Json& j) {
  return j.is_number_integer() && j.template get<int64_t>() >= 0;
}

bool parse_dtype(const std::string& s, tensor::DType* out) {
  for (tensor::DType t : {tensor::DType::kF32, tensor::DType::kBF16, tensor::DType::kF16, tensor::DType::kI32}) {
    if (s == safetensors_dtype_name(t)) {
      *out = t;
      return true;
    }
  }
  return false;
}

// An open file descriptor that closes itself; writes everything or throws.
class OutFile {
 public:
  explicit OutFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create");
  }
  ~OutFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  void write(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail("cannot write");
      }
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void sync_and_close() {
    if (::fsync(fd_) != 0) fail("cannot flush");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot flush");
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw IoError(std::string("safetensors: ") + what + " " + quoted(path_) + ": " +
                  std::strerror(errno));
  }
  fs::path path_;
  int fd_ = -1;
};

void sync_dir(const fs::path& dir) {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: some filesystems refuse
  ::fsync(fd);
  ::close(fd);
}

std::string header_text(const std::vector<WeightTensor>& tensors, const WeightMetadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header[kMetadataKey] = std::move(m);
  }
  uint64_t offset = 0;
  for (const WeightTensor& t : tensors) {
    const uint64_t end = offset + t.bytes.size();
    header[t.name] = {{"dtype", std::string(safetensors_dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  // 8 + N is a multiple of 8, so the data starts aligned for any element type.
  text.resize(round_up(text.size(), 8), ' ');
  return text;
}

// Every dtype of the safetensors format with its element size; porter computes in the first
// four (parse_dtype).
struct DtypeSize {
  std::string_view name;
  size_t bytes;
};
constexpr DtypeSize kSafetensorsDtypes[] = {
    {"F32", 4}, {"BF16", 2}, {"F16", 2},     {"I32", 4},     {"F64", 8},     {"I64", 8},
    {"U64", 8}, {"U32", 4},  {"I16", 2},     {"U16", 2},     {"I8", 1},      {"U8", 1},
    {"BOOL", 1}, {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
};

std::optional<size_t> safetensors_dtype_bytes(std::string_view name) {
  for (const DtypeSize& d : kSafetensorsDtypes) {
    if (d.name == name) return d.bytes;
  }
  return std::nullopt;
}

// The header length is in range for a file of `file_bytes` (Note [Safetensors format]).
uint64_t check_header_length(uint64_t header_bytes, uint64_t file_bytes, const std::string& where) {
  if (header_bytes > kMaxHeaderBytes) {
    throw IoError(where + "bad header length " + std::to_string(header_bytes) +
                  ": above the limit of " + std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_bytes > file_bytes - 8) {
    throw IoError(where + "bad header length " + std::to_string(header_bytes) + ": the file has " +
                  std::to_string(file_bytes - 8) + " bytes after it (truncated, or not a "
                  "safetensors file)");
  }
  return header_bytes;
}

// The header's tensors in offset order, each checked against `data_bytes` of data, and the
// tensors tiling the data (Note [Safetensors format]); its metadata into `metadata`. The
// messages start with `where`.
std::vector<SafetensorsEntry> parse_header(std::string_view text, uint64_t data_bytes,
                                           const std::string& where, WeightMetadata& metadata) {
  if (text.empty() || text[0] != '{') {
    throw IoError(where + "the header does not start with '{' (not a safetensors file)");
  }
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw IoError(where + "the header is not valid JSON: " + e.what());
  }
  if (!header.is_object()) throw IoError(where + "the header is not a JSON object");

  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == kMetadataKey) {
      if (!value.is_object()) throw IoError(where + "\"__metadata__\" is not a JSON object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) {
          throw IoError(where + "metadata \"" + k + "\" is " + v.dump() +
                        ", not a string (metadata maps strings to strings)");
        }
        metadata[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string what = where + "tensor '" + name + "': ";
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets")) {
      throw IoError(what + "needs \"dtype\", \"shape\" and \"data_offsets\", has " + value.dump());
    }
    SafetensorsEntry e;
    e.name = name;
    const auto& dtype = value["dtype"];
    const std::optional<size_t> elem_bytes =
        dtype.is_string() ? safetensors_dtype_bytes(dtype.get<std::string>()) : std::nullopt;
    if (!elem_bytes) {
      throw IoError(what + "unknown dtype " + dtype.dump() + " (not a safetensors dtype)");
    }
    e.dtype = dtype.get<std::string>();
    tensor::DType porter = tensor::DType::kF32;
    if (parse_dtype(e.dtype, &porter)) e.porter_dtype = porter;
    const auto& shape = value["shape"];
    if (!shape.is_array()) throw IoError(what + "shape " + shape.dump() + " is not an array");
    for (const auto& d : shape) {
      if (!is_count(d)) {
        throw IoError(what + "shape " + shape.dump() + " has a dimension that is not a "
                      "non-negative integer");
      }
      e.shape.push_back(d.get<int64_t>());
    }
    e.numel = checked_numel(e.shape);
    if (e.numel < 0) throw IoError(what + "shape " + shape.dump() + " overflows");
    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !is_count(offsets[0]) ||
        !is_count(offsets[1])) {
      throw IoError(what + "data_offsets " + offsets.dump() + " is not [begin, end]");
    }
    e.begin = offsets[0].get<uint64_t>();
    e.end = offsets[1].get<uint64_t>();
    if (e.begin > e.end) {
      throw IoError(what + "data_offsets " + offsets.dump() + " end before they begin");
    }
    if (e.end > data_bytes) {
      throw IoError(what + "data_offsets " + offsets.dump() + " are past the end of the data (" +
                    std::to_string(data_bytes) + " bytes: the file is truncated or the offsets "
                    "are wrong)");
    }
    uint64_t need = 0;
    const bool overflow = __builtin_mul_overflow(static_cast<uint64_t>(e.numel), *elem_bytes, &need);
    if (overflow || e.end - e.begin != need) {
      throw IoError(what + "wrong byte count: data_offsets " + offsets.dump() + " hold " +
                    std::to_string(e.end - e.begin) + " bytes, shape " + shape_string(e.shape) +
                    " of " + e.dtype + " needs " +
                    (overflow ? std::string("more than 2^64") : std::to_string(need)));
    }
    entries.push_back(std::move(e));
  }
  std::stable_sort(entries.begin(), entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Note [Safetensors format]: the tensors tile the data.
  uint64_t at = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    if (e.begin < at) {
      throw IoError(where + "tensors '" + entries[i - 1].name + "' [" +
                    std::to_string(entries[i - 1].begin) + ", " + std::to_string(entries[i - 1].end) +
                    ") and '" + e.name + "' [" + std::to_string(e.begin) + ", " +
                    std::to_string(e.end) + ") overlap");
    }
    if (e.begin > at) {
      throw IoError(where + "bytes [" + std::to_string(at) + ", " + std::to_string(e.begin) +
                    ") of the data belong to no tensor (a gap before '" + e.name + "')");
    }
    at = e.end;
  }
  if (at != data_bytes) {
    throw IoError(where + "the data has " + std::to_string(data_bytes) + " bytes, the tensors end at " +
                  std::to_string(at) + " (trailing bytes belong to no tensor)");
  }
  return entries;
}

}  // namespace

int64_t WeightTensor::numel() const { return checked_numel(shape); }

std::string_view safetensors_dtype_name(tensor::DType dtype) {
  switch (dtype) {
    case tensor::DType::kF32: return "F32";
    case tensor::DType::kBF16: return "BF16";
    case tensor::DType::kF16: return "F16";
    case tensor::DType::kI32: return "I32";
    case tensor::DType::kI64: return "I64";
    case tensor::DType::kBool: return "BOOL";
  }
  return "?";
}

void write_safetensors(const fs::path& path, const std::vector<WeightTensor>& tensors,
                       const WeightMetadata& metadata) {
  std::set<std::string> names;
  for (const WeightTensor& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      throw InvalidArgument("write_safetensors " + quoted(path) + ": tensor name \"" + t.name +
                            "\" is " + (t.name.empty() ? "empty" : "reserved for the metadata"));
    }
    if (!names.insert(t.name).second) {
      throw InvalidArgument("write_safetensors " + quoted(path) + ": tensor \"" + t.name +
                            "\" appears twice");
    }
    const int64_t n = t.numel();
    if (n < 0) {
      throw InvalidArgument("write_safetensors " + quoted(path) + ": tensor \"" + t.name +
                            "\" has an invalid shape " + shape_string(t.shape));
    }
    const uint64_t need = static_cast<uint64_t>(n) * tensor::dtype_size(t.dtype);
    if (t.bytes.size() != need) {
      throw InvalidArgument("write_safetensors " + quoted(path) + ": tensor \"" + t.name +
                            "\" " + shape_string(t.shape) + " " +
                            std::string(safetensors_dtype_name(t.dtype)) + " has " +
                            std::to_string(t.bytes.size()) + " bytes, its shape needs " +
                            std::to_string(need));
    }
  }
  const std::string header = header_text(tensors, metadata);

  const fs::path parent = path.parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) {
      throw IoError("safetensors: cannot create directory " + quoted(parent) + ": " + ec.message());
    }
  }
  const fs::path tmp = parent / ("." + path.filename().string() + ".tmp." + std::to_string(::getpid()));
  try {
    OutFile out(tmp);
    unsigned char length[8];
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
    out.write(length, sizeof length);
    out.write(header.data(), header.size());
    for (const WeightTensor& t : tensors) out.write(t.bytes.data(), t.bytes.size());
    out.sync_and_close();
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) {
      throw IoError("safetensors: cannot rename " + quoted(tmp) + " to " + quoted(path) + ": " +
                    ec.message());
    }
  } catch (...) {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    throw;
  }
  sync_dir(parent);
}

std::vector<WeightTensor> read_safetensors(const fs::path& path, WeightMetadata* metadata) {
  const SafetensorsFile file(path);
  for (const SafetensorsEntry& e : file.tensors()) {
    if (!e.porter_dtype) {
      throw IoError("safetensors " + quoted(path) + ": tensor '" + e.name + "': unknown dtype \"" +
                    e.dtype + "\" (porter reads F32, BF16, F16, I32)");
    }
  }
  std::vector<WeightTensor> out;
  out.reserve(file.tensors().size());
  for (const SafetensorsEntry& e : file.tensors()) {
    const std::span<const std::byte> bytes = file.bytes(e);
    out.push_back(WeightTensor{e.name, e.shape, *e.porter_dtype, {bytes.begin(), bytes.end()}});
  }
  if (metadata) {
    for (const auto& [k, v] : file.metadata()) (*metadata)[k] = v;
  }
  return out;
}

SafetensorsFile::SafetensorsFile(const fs::path& path) : path_(path) {
  const std::string where = "safetensors " + quoted(path) + ": ";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw IoError(where + "cannot read: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw IoError(where + "cannot read: " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(where + "cannot read: not a regular file");
  }
  file_bytes_ = static_cast<uint64_t>(st.st_size);
  if (file_bytes_ < 8) {
    ::close(fd);
    throw IoError(where + "truncated: " + std::to_string(file_bytes_) +
                  " bytes, less than the 8-byte header length");
  }
  void* m = ::mmap(nullptr, static_cast<size_t>(file_bytes_), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file open
  if (m == MAP_FAILED) throw IoError(where + "cannot map: " + std::strerror(map_errno));
  map_ = static_cast<const std::byte*>(m);
  map_bytes_ = static_cast<size_t>(file_bytes_);
  try {
    uint64_t header_bytes = 0;
    for (int i = 0; i < 8; ++i) {
      header_bytes |= static_cast<uint64_t>(std::to_integer<uint8_t>(map_[i])) << (8 * i);
    }
    const std::string_view text(reinterpret_cast<const char*>(map_) + 8,
                                check_header_length(header_bytes, file_bytes_, where));
    data_begin_ = 8 + header_bytes;
    tensors_ = parse_header(text, file_bytes_ - data_begin_, where, metadata_);
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  } catch (...) {
    unmap();
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      file_bytes_(other.file_bytes_),
      data_begin_(other.data_begin_),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    file_bytes_ = other.file_bytes_;
    data_begin_ = other.data_begin_;
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

void SafetensorsFile::unmap() noexcept {
  if (map_ != nullptr) ::munmap(const_cast<std::byte*>(map_), map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::bytes(const SafetensorsEntry& e) const {
  // parse_header checked end <= the data's bytes, so this is inside the mapping.
  return {map_ + data_begin_ + e.begin, static_cast<size_t>(e.end - e.begin)};
}

std::vector<FlatTensorSpec> layout_specs(const nn::ParamLayout& layout) {
  std::vector<FlatTensorSpec> out;
  for (const nn::ParamEntry& e : layout.entries()) {
    out.push_back({e.name, e.shape.to_vector(), e.offset_elems});
  }
  return out;
}

std::vector<FlatTensorSpec> layout_specs(const nlohmann::json& layout, const std::string& what) {
  const std::string where = what + ": layout: ";
  if (!layout.is_object() || !layout.contains("total_elems") ||
      !is_count(layout["total_elems"]) || !layout.contains("params") ||
      !layout["params"].is_array()) {
    throw IoError(where + "needs \"total_elems\" (an integer) and \"params\" (an array)");
  }
  const int64_t total = layout["total_elems"].get<int64_t>();
  std::vector<FlatTensorSpec> out;
  int64_t prev_end = 0;
  for (size_t i = 0; i < layout["params"].size(); ++i) {
    const nlohmann::json& p = layout["params"][i];
    const std::string at = where + "params[" + std::to_string(i) + "]";
    if (!p.is_object() || !p.contains("name") || !p["name"].is_string() || !p.contains("shape") ||
        !p["shape"].is_array() || !p.contains("offset") || !is_count(p["offset"])) {
      throw IoError(at + " needs \"name\", \"shape\" and \"offset\", has " + p.dump());
    }
    FlatTensorSpec s;
    s.name = p["name"].get<std::string>();
    for (const nlohmann::json& d : p["shape"]) {
      if (!is_count(d)) throw IoError(at + " ('" + s.name + "'): bad shape " + p["shape"].dump());
      s.shape.push_back(d.get<int64_t>());
    }
    s.offset_elems = p["offset"].get<int64_t>();
    const int64_t n = checked_numel(s.shape);
    int64_t end = 0;
    if (n < 0 || __builtin_add_overflow(s.offset_elems, n, &end) || end > total) {
      throw IoError(at + " ('" + s.name + "'): shape " + p["shape"].dump() + " at offset " +
                    std::to_string(s.offset_elems) + " ends past total_elems " +
                    std::to_string(total));
    }
    if (s.offset_elems < prev_end) {
      throw IoError(at + " ('" + s.name + "'): offset " + std::to_string(s.offset_elems) +
                    " overlaps the previous parameter, which ends at " + std::to_string(prev_end));
    }
    prev_end = end;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<WeightTensor> layout_tensors(std::span<const FlatTensorSpec> specs, tensor::DType dtype,
                                         std::span<const std::byte> flat_bytes) {
  const size_t size = tensor::dtype_size(dtype);
  if (flat_bytes.size() % size != 0) {
    throw InvalidArgument("layout_tensors: " + std::to_string(flat_bytes.size()) +
                          " bytes are not a whole number of " + std::string(tensor::dtype_name(dtype)) +
                          " elements");
  }
  const int64_t flat_elems = static_cast<int64_t>(flat_bytes.size() / size);
  std::vector<WeightTensor> out;
  out.reserve(specs.size());
  for (const FlatTensorSpec& s : specs) {
    const int64_t n = checked_numel(s.shape);
    if (n < 0 || s.offset_elems < 0 || s.offset_elems + n > flat_elems) {
      throw InvalidArgument("layout_tensors: '" + s.name + "' " + shape_string(s.shape) +
                            " at offset " + std::to_string(s.offset_elems) +
                            " does not fit in a flat buffer of " + std::to_string(flat_elems) +
                            " elements");
    }
    WeightTensor t;
    t.name = s.name;
    t.shape = s.shape;
    t.dtype = dtype;
    const auto first = flat_bytes.begin() + static_cast<ptrdiff_t>(s.offset_elems * static_cast<int64_t>(size));
    t.bytes.assign(first, first + static_cast<ptrdiff_t>(n * static_cast<int64_t>(size)));
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<WeightTensor> layout_tensors(const nn::ParamLayout& layout, tensor::DType dtype,
                                         std::span<const std::byte> flat_bytes) {
  const std::vector<FlatTensorSpec> specs = layout_specs(layout);
  return layout_tensors(specs, dtype, flat_bytes);
}

std::vector<std::byte> to_f32_bytes(tensor::DType from, std::span<const std::byte> bytes) {
  if (from == tensor::DType::kF32) return {bytes.begin(), bytes.end()};
  if (from != tensor::DType::kBF16 && from != tensor::DType::kF16) {
    throw InvalidArgument("to_f32_bytes: cannot convert " + std::string(tensor::dtype_name(from)) +
                          " to f32");
  }
  const size_t n = bytes.size() / 2;
  std::vector<std::byte> out(n * 4);
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    const float f = from == tensor::DType::kBF16 ? tensor::bf16_to_f32(h) : tensor::f16_to_f32(h);
    std::memcpy(out.data() + 4 * i, &f, 4);
  }
  return out;
}

}  // namespace porter::io
