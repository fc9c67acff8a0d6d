// Flash-attention FFI handlers: validate buffers and attributes, pick kernels, build the
// dispatch plan, and run it on a Device. The plan is shared by both devices, so the emulated
// device exercises exactly what the Metal device encodes. See attention_ffi.h for the contract.
#include "attention_ffi.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_params.h"
#include "attribute_decoding.h"
#include "device.h"
#include "dispatch_plan.h"
#include "function_constants.h"
#include "host_timing.h"
#include "plan_cache.h"
#include "working_memory.h"
#include "xla/ffi/api/ffi.h"


namespace ffi = xla::ffi;

namespace jfm {
namespace {

ffi::Error invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_flash_metal: " + message);
}

const char* dtype_suffix(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "f32";
    case ffi::DataType::F16:
      return "f16";
    case ffi::DataType::BF16:
      return "bf16";
    default:
      return nullptr;
  }
}

std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U32:
      return "uint32";
    default:
      return "dtype #" + std::to_string(static_cast<int>(t));
  }
}

// A shape of rank <= 4 held in place: a call checks about a dozen, with no allocation.
struct Shape {
  int64_t dims[4] = {0, 0, 0, 0};
  size_t rank = 0;

  Shape(std::initializer_list<int64_t> values) : rank(std::min<size_t>(values.size(), 4)) {
    std::copy(values.begin(), values.begin() + rank, dims);
  }
  size_t size() const { return rank; }
  int64_t operator[](size_t i) const { return dims[i]; }
  const int64_t* begin() const { return dims; }
  const int64_t* end() const { return dims + rank; }
};

template <typename Dims>  // ffi::AnyBuffer::Dimensions or Shape
std::string dims_string(const Dims& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

bool same_dims(ffi::AnyBuffer::Dimensions dims, const Shape& want) {
  return dims.size() == want.size() && std::equal(want.begin(), want.end(), dims.begin());
}

struct Problem {
  int64_t batch = 0, q_len = 0, kv_len = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t value_head_dim = 0;  // of V, O, dO and dV (head_dim: of Q, K, dQ and dK)
  int64_t page_size = 0, num_pages = 0;  // a paged K/V cache (has_page_table), else 0
  ffi::DataType dtype = ffi::DataType::F32;
  const char* suffix = nullptr;  // f32 / f16 / bf16
  bool dropout = false;          // dropout_rate > 0: the forward runs the tiled kernel
  int variant = 0;               // the kernels' tile variant (kernel_variant)

  Shape q_shape() const { return {batch, q_len, heads, head_dim}; }
  Shape o_shape() const { return {batch, q_len, heads, value_head_dim}; }
  Shape k_shape() const { return {batch, kv_len, kv_heads, head_dim}; }
  Shape v_shape() const { return {batch, kv_len, kv_heads, value_head_dim}; }
  Shape row_shape() const { return {batch, heads, q_len}; }
};

// q, k, v: ranks, matching dims, one supported dtype, divisible heads. With `paged` k and v are
// pages [num_pages, page_size, HKV, D] and kv_len is left to read_page_table.
ffi::Error read_problem(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, bool paged,
                        Problem* p) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4) {
    return invalid("query must have rank 4 [batch, q_len, num_heads, head_dim], got shape " +
                   dims_string(qd));
  }
  if (kd.size() != 4) {
    return invalid(std::string("key must have rank 4 ") +
                   (paged ? "[num_pages, page_size" : "[batch, kv_len") +
                   ", num_kv_heads, head_dim], got shape " + dims_string(kd));
  }
  p->batch = qd[0];
  p->q_len = qd[1];
  p->heads = qd[2];
  p->head_dim = qd[3];
  p->kv_len = paged ? 0 : kd[1];
  p->kv_heads = kd[2];
  if (paged) {
    p->num_pages = kd[0];
    p->page_size = kd[1];
  }
  if ((!paged && kd[0] != p->batch) || kd[3] != p->head_dim) {
    return invalid("key shape " + dims_string(kd) + " does not match query shape " +
                   dims_string(qd) + " in batch or head_dim");
  }
  p->value_head_dim = vd.size() == 4 ? vd[3] : 0;
  if (!same_dims(vd, {kd[0], kd[1], kd[2], p->value_head_dim})) {
    return invalid("value shape " + dims_string(vd) + " must have rank 4 and match key shape " +
                   dims_string(kd) + " in " +
                   (paged ? "num_pages, page_size" : "batch, kv_len") + " and num_kv_heads");
  }
  p->dtype = q.element_type();
  p->suffix = dtype_suffix(p->dtype);
  if (p->suffix == nullptr) {
    return invalid("query dtype must be float32, float16 or bfloat16");
  }
  if (k.element_type() != p->dtype || v.element_type() != p->dtype) {
    return invalid("query, key and value must share one dtype");
  }
  if (p->kv_heads == 0 ? p->heads != 0 : p->heads % p->kv_heads != 0) {
    return invalid("num_heads (" + std::to_string(p->heads) +
                   ") must be a multiple of num_kv_heads (" + std::to_string(p->kv_heads) + ")");
  }
  // AttentionParams holds 32-bit dims.
  for (int64_t dim : {p->batch, p->q_len, p->kv_len, p->heads, p->kv_heads, p->head_dim,
                      p->value_head_dim}) {
    if (dim > std::numeric_limits<int32_t>::max()) {
      return invalid("dimension " + std::to_string(dim) + " exceeds 2^31 - 1");
    }
  }
  return ffi::Error::Success();
}

ffi::Error expect(const char* what, ffi::AnyBuffer buffer, ffi::DataType dtype,
                  const Shape& shape) {
  if (buffer.element_type() != dtype || !same_dims(buffer.dimensions(), shape)) {
    return invalid(std::string(what) + " must be " + dtype_name(dtype) + " " +
                   dims_string(shape) + ", got " + dtype_name(buffer.element_type()) + " " +
                   dims_string(buffer.dimensions()));
  }
  return ffi::Error::Success();
}

ffi::Error check_attributes(const Attributes& o) {
  if (o.window_left < JFM_UNBOUNDED || o.window_right < JFM_UNBOUNDED) {
    return invalid("window_left/window_right must be >= 0, or -1 for unbounded; got (" +
                   std::to_string(o.window_left) + ", " + std::to_string(o.window_right) + ")");
  }
  if (!(o.logits_soft_cap >= 0.0f) || std::isinf(o.logits_soft_cap)) {
    return invalid("logits_soft_cap must be a positive finite float, or 0 for none; got " +
                   std::to_string(o.logits_soft_cap));
  }
  if (!(o.dropout_rate >= 0.0 && o.dropout_rate < 1.0)) {
    return invalid("dropout_rate must be in [0, 1); got " + std::to_string(o.dropout_rate));
  }
  if (o.kernel_variant < 0 || o.kernel_variant >= JFM_TILE_VARIANTS) {
    return invalid("kernel_variant must be in [0, " + std::to_string(JFM_TILE_VARIANTS) +
                   "); got " + std::to_string(o.kernel_variant));
  }
  return ffi::Error::Success();
}

bool flag_set(bool flag) { return flag; }
bool flag_set(double rate) { return rate > 0.0; }  // dropout_rate

// JFM_OPTIONAL_OPERANDS's names, by Operand.
const char* const kOperandNames[kOperandCount] = {
#define JFM_OPERAND_NAME(name, flag) #name,
    JFM_OPTIONAL_OPERANDS(JFM_OPERAND_NAME)
#undef JFM_OPERAND_NAME
};

// Where each optional operand of a call is among the handler's remaining args: its position
// (the present operands before it in JFM_OPTIONAL_OPERANDS's order), or -1 when absent.
struct OperandSlots {
  int index[kOperandCount];
  size_t count = 0;  // the present operands
};

OperandSlots operand_slots(const Attributes& o) {
  OperandSlots slots;
  const bool present[kOperandCount] = {
#define JFM_OPERAND_PRESENT(name, flag) flag_set(o.flag),
      JFM_OPTIONAL_OPERANDS(JFM_OPERAND_PRESENT)
#undef JFM_OPERAND_PRESENT
  };
  for (int n = 0; n < kOperandCount; ++n) {
    slots.index[n] = present[n] ? static_cast<int>(slots.count++) : -1;
  }
  return slots;
}

// The present operand `id` of a call, from its own slot.
ffi::ErrorOr<ffi::AnyBuffer> operand_at(ffi::RemainingArgs rest, const OperandSlots& slots,
                                        Operand id) {
  const char* name = kOperandNames[id];
  if (slots.index[id] < 0 || static_cast<size_t>(slots.index[id]) >= rest.size()) {
    return ffi::Unexpected(invalid(std::string(name) + ": operand missing"));
  }
  auto arg = rest.get<ffi::AnyBuffer>(static_cast<size_t>(slots.index[id]));
  if (arg.has_error()) {
    return ffi::Unexpected(invalid(std::string(name) + ": " + arg.error().message()));
  }
  return arg.value();
}

// A paged call's table, ahead of the other optional operands (their shapes use the logical
// kv_len it gives): int32 [batch, max_pages], a supported page size, kv_lengths present.
ffi::Error read_page_table(ffi::RemainingArgs rest, const Attributes& o, Problem* p) {
  if (!o.has_kv_lengths) {
    return invalid("page_table needs kv_lengths (the keys in use of each row's pages)");
  }
  if (!jfm_page_size_supported(p->page_size)) {
    return invalid("page_table: page_size " + std::to_string(p->page_size) +
                   " is not a power of two >= 16 (the kernels' key blocks must tile pages)");
  }
  auto arg = operand_at(rest, operand_slots(o), kOperand_page_table);
  if (arg.has_error()) return arg.error();
  auto dims = arg.value().dimensions();
  if (arg.value().element_type() != ffi::DataType::S32 || dims.size() != 2 ||
      dims[0] != p->batch) {
    return invalid("page_table must be int32 [" + std::to_string(p->batch) +
                   ", max_pages], got " + dtype_name(arg.value().element_type()) + " " +
                   dims_string(dims));
  }
  p->kv_len = dims[1] * p->page_size;
  if (p->kv_len > std::numeric_limits<int32_t>::max() ||
      p->num_pages * p->page_size > std::numeric_limits<int32_t>::max()) {
    return invalid("page_table: max_pages * page_size and num_pages * page_size must not "
                   "exceed 2^31 - 1");
  }
  return ffi::Error::Success();
}

// The backward's dbias result: the full score layout with bias_grad, else empty.
Shape dbias_shape(const Problem& p, bool bias_grad) {
  if (!bias_grad) return {0};
  return {p.batch, p.heads, p.q_len, p.kv_len};
}

// The backward's dalibi result: one slope-gradient share per query row with alibi_grad, else
// empty.
Shape dalibi_shape(const Problem& p, bool alibi_grad) {
  if (!alibi_grad) return {0};
  return p.row_shape();
}

Binding whole(int index, ffi::AnyBuffer buffer, bool written) {
  return Binding{index, buffer.untyped_data(), buffer.size_bytes(), written, false};
}

// A call's copy of int32 lengths [rows]: in place up to kInlineRows rows (a decode's batch),
// so a small call allocates nothing for it; held where the bindings point, so not copyable.
class Lengths {
 public:
  Lengths() = default;
  Lengths(const Lengths&) = delete;
  Lengths& operator=(const Lengths&) = delete;

  void assign(size_t rows, int32_t value) {
    if (rows > kInlineRows) {
      heap_.assign(rows, value);
      data_ = heap_.data();
    } else {
      std::fill_n(inline_, rows, value);
      data_ = inline_;
    }
    size_ = rows;
  }
  int32_t* data() { return data_; }
  size_t size() const { return size_; }

 private:
  static constexpr size_t kInlineRows = 8;
  int32_t inline_[kInlineRows] = {};
  std::vector<int32_t> heap_;
  int32_t* data_ = inline_;
  size_t size_ = 0;
};

// The optional operands of a call (attention_ffi.h), as the kernels bind them.
struct OptionalOperands {
  // Copied for binding. Clamping to [0, len] happens where the kernels read them
  // (jfm_valid_len), so nothing indexes out of bounds whatever the caller passes. When a length
  // is absent, the full length fills the buffer the kernel does not read.
  Lengths q_lengths, kv_lengths;
  // Buffers 16-20, 23 and 25 for every kernel of the call; an absent one is bound to
  // `placeholder`, never read (its flag is 0), so every kernel argument is bound on Metal.
  // At most one per optional operand: a fixed array, no allocation per call.
  std::array<Binding, kOperandCount> features;
  size_t feature_count = 0;

  void add_feature(const Binding& b) { features[feature_count++] = b; }
  uint32_t bias_kind = JFM_BIAS_NONE;
  int64_t bias_strides[4] = {0, 0, 0, 0}, mask_strides[4] = {0, 0, 0, 0};
  int32_t placeholder[4] = {0, 0, 0, 0};
  const float* sinks = nullptr;  // float32 [H] when has_sinks

  // Buffer `index` bound to the placeholder (a kernel argument nothing reads).
  Binding unused(int index) {
    return Binding{index, placeholder, sizeof(placeholder), false, true};
  }
};

// Element strides of a rank-4 row-major array over [B, H, Tq, Tkv], 0 on a broadcast axis (size
// 1; the kernels then read index 0 of it for every position).
void broadcast_strides(ffi::AnyBuffer::Dimensions dims, int64_t* strides) {
  int64_t step = 1;
  for (int axis = 3; axis >= 0; --axis) {
    strides[axis] = dims[axis] == 1 ? 0 : step;
    step *= dims[axis];
  }
}

// A bias or mask: rank 4, each axis 1 or the full size of [B, H, Tq, Tkv].
ffi::Error expect_broadcastable(const char* what, ffi::AnyBuffer buffer, const Problem& p) {
  const Shape full = {p.batch, p.heads, p.q_len, p.kv_len};
  auto dims = buffer.dimensions();
  bool ok = dims.size() == 4;
  for (size_t axis = 0; ok && axis < 4; ++axis) {
    ok = dims[axis] == 1 || dims[axis] == full[axis];
  }
  if (ok) return ffi::Error::Success();
  return invalid(std::string(what) + " must have rank 4 with each axis 1 or the size of " +
                 dims_string(full) + ", got shape " + dims_string(dims));
}

// The call's operand count against its flags.
ffi::Error check_operand_count(ffi::RemainingArgs rest, const OperandSlots& slots) {
  if (rest.size() == slots.count) return ffi::Error::Success();
  std::string names;
  for (int n = 0; n < kOperandCount; ++n) {
    if (slots.index[n] >= 0) names += std::string(names.empty() ? "" : ", ") + kOperandNames[n];
  }
  return invalid("expected " + std::to_string(slots.count) + " optional operand(s) after the " +
                 "arrays (" + (names.empty() ? "none" : names) + ", by the has_* attributes " +
                 "and dropout_rate), got " + std::to_string(rest.size()));
}

// A length operand int32 [B], copied for binding.
ffi::Error copy_lengths(const char* what, ffi::AnyBuffer buffer, const Problem& p,
                        Lengths* values) {
  if (ffi::Error e = expect(what, buffer, ffi::DataType::S32, {p.batch}); e.failure()) return e;
  const int32_t* data = static_cast<const int32_t*>(buffer.untyped_data());
  std::copy(data, data + p.batch, values->data());
  return ffi::Error::Success();
}

ffi::Error check_bias(ffi::AnyBuffer b, const Problem& p, OptionalOperands* out) {
  const ffi::DataType t = b.element_type();
  if (t != p.dtype && t != ffi::DataType::F32) {
    return invalid("bias must have the dtype of query (" + dtype_name(p.dtype) +
                   ") or float32, got " + dtype_name(t));
  }
  if (ffi::Error e = expect_broadcastable("bias", b, p); e.failure()) return e;
  out->bias_kind = t == p.dtype ? JFM_BIAS_OF_Q : JFM_BIAS_FLOAT32;
  broadcast_strides(b.dimensions(), out->bias_strides);
  return ffi::Error::Success();
}

ffi::Error check_mask(ffi::AnyBuffer b, const Problem& p, OptionalOperands* out) {
  const ffi::DataType t = b.element_type();
  if (t != ffi::DataType::PRED && t != ffi::DataType::U8) {
    return invalid("mask must be bool or uint8 (0 = hidden), got " + dtype_name(t));
  }
  if (ffi::Error e = expect_broadcastable("mask", b, p); e.failure()) return e;
  broadcast_strides(b.dimensions(), out->mask_strides);
  return ffi::Error::Success();
}

// Checks the present operand `id`'s dtype and shape and keeps what the kernels need of it.
ffi::Error check_operand(Operand id, ffi::AnyBuffer b, const Problem& p, OptionalOperands* out) {
  const char* what = kOperandNames[id];
  const ffi::DataType s32 = ffi::DataType::S32, f32 = ffi::DataType::F32;
  switch (id) {
    case kOperand_q_lengths:
      return copy_lengths(what, b, p, &out->q_lengths);
    case kOperand_kv_lengths:
      return copy_lengths(what, b, p, &out->kv_lengths);
    case kOperand_q_segment_ids:
      return expect(what, b, s32, {p.batch, p.q_len});
    case kOperand_kv_segment_ids:
      return expect(what, b, s32, {p.batch, p.kv_len});
    case kOperand_bias:
      return check_bias(b, p, out);
    case kOperand_mask:
      return check_mask(b, p, out);
    case kOperand_sinks:
      out->sinks = static_cast<const float*>(b.untyped_data());
      return expect(what, b, f32, {p.heads});
    case kOperand_alibi_slopes:
      return expect(what, b, f32, {p.batch, p.heads});
    case kOperand_page_table:  // checked by read_page_table
      return ffi::Error::Success();
    case kOperand_dropout:
      return expect(what, b, ffi::DataType::U32, {p.batch, p.heads, 4});
    case kOperandCount:
      break;
  }
  return invalid(std::string("no check for the optional operand ") + what);
}

// The kernel buffer an optional operand is bound to in place; -1 for the lengths, which are
// copied (with_optional binds them).
int buffer_of(Operand id) {
  switch (id) {
    case kOperand_q_segment_ids:
      return JFM_BUFFER_Q_SEGMENT_IDS;
    case kOperand_kv_segment_ids:
      return JFM_BUFFER_KV_SEGMENT_IDS;
    case kOperand_bias:
      return JFM_BUFFER_BIAS;
    case kOperand_mask:
      return JFM_BUFFER_MASK;
    case kOperand_sinks:
      return JFM_BUFFER_SINKS;
    case kOperand_alibi_slopes:
      return JFM_BUFFER_ALIBI_SLOPES;
    case kOperand_page_table:
      return JFM_BUFFER_PAGE_TABLE;
    case kOperand_dropout:
      return JFM_BUFFER_DROPOUT;
    default:
      return -1;
  }
}

// Reads the optional operands after the main ones (JFM_OPTIONAL_OPERANDS), each from its own
// slot (operand_slots), checks their dtypes and shapes, and prepares their bindings and
// strides. One function for both directions, so both see one set of rules.
ffi::Error read_optional(ffi::RemainingArgs rest, const Attributes& o, const Problem& p,
                         OptionalOperands* out) {
  const OperandSlots slots = operand_slots(o);
  if (ffi::Error e = check_operand_count(rest, slots); e.failure()) return e;
  const size_t rows = static_cast<size_t>(std::max<int64_t>(p.batch, 1));
  out->q_lengths.assign(rows, static_cast<int32_t>(p.q_len));
  out->kv_lengths.assign(rows, static_cast<int32_t>(p.kv_len));
  out->feature_count = 0;  // every feature buffer: bound, or its placeholder
  for (int n = 0; n < kOperandCount; ++n) {
    const Operand id = static_cast<Operand>(n);
    const int buffer = buffer_of(id);
    if (slots.index[id] < 0) {  // absent: a bound placeholder nothing reads (its flag is 0)
      if (buffer >= 0) out->add_feature(out->unused(buffer));
      continue;
    }
    auto arg = operand_at(rest, slots, id);
    if (arg.has_error()) return arg.error();
    if (ffi::Error e = check_operand(id, arg.value(), p, out); e.failure()) return e;
    if (buffer >= 0) out->add_feature(whole(buffer, arg.value(), false));
  }
  return ffi::Error::Success();
}

ffi::Error require_kernel(Device& device, const std::string& kernel, const Problem& p) {
  if (device.has_kernel(kernel)) return ffi::Error::Success();
  std::string message = (p.value_head_dim == p.head_dim
                             ? "head_dim " + std::to_string(p.head_dim)
                             : "key head dim " + std::to_string(p.head_dim) +
                                   " with value head dim " + std::to_string(p.value_head_dim)) +
                        " with dtype " + p.suffix +
                        " is not supported by the " + device.kind() + " device (no kernel '" +
                        kernel + "')";
  std::string why = device.library_error();
  if (!why.empty()) message += "; shader library error: " + why;
  return invalid(message);
}

AttentionParams make_params(const Problem& p, const Attributes& o, const OptionalOperands& x) {
  AttentionParams params{};
  params.batch = static_cast<uint32_t>(p.batch);
  params.q_len = static_cast<uint32_t>(p.q_len);
  params.kv_len = static_cast<uint32_t>(p.kv_len);
  params.num_heads = static_cast<uint32_t>(p.heads);
  params.num_kv_heads = static_cast<uint32_t>(p.kv_heads);
  params.head_dim = static_cast<uint32_t>(p.head_dim);
  params.scale = o.scale;
  params.window_left = o.window_left;
  params.window_right = o.window_right;
  params.causal = o.is_causal ? 1u : 0u;
  params.bottom_right = o.bottom_right ? 1u : 0u;
  params.has_q_lengths = o.has_q_lengths ? 1u : 0u;
  params.has_kv_lengths = o.has_kv_lengths ? 1u : 0u;
  params.has_segment_ids = o.has_segment_ids ? 1u : 0u;
  params.has_bias = x.bias_kind;
  params.has_mask = o.has_mask ? 1u : 0u;
  params.has_sinks = o.has_sinks ? 1u : 0u;
  params.soft_cap = o.logits_soft_cap;
  params.bias_grad = o.bias_grad ? 1u : 0u;
  params.has_alibi = o.has_alibi ? 1u : 0u;
  params.alibi_grad = o.alibi_grad ? 1u : 0u;
  params.page_size = static_cast<uint32_t>(p.page_size);
  params.num_pages = static_cast<uint32_t>(p.num_pages);
  if (o.dropout_rate > 0.0) {  // jax_flash_metal/dropout.py's threshold and keep_scale, exactly
    params.dropout_threshold = static_cast<uint32_t>(std::floor(o.dropout_rate * 4294967296.0));
    params.dropout_scale = static_cast<float>(1.0 / (1.0 - o.dropout_rate));
  }
  std::copy(x.bias_strides, x.bias_strides + 4, params.bias_strides);
  std::copy(x.mask_strides, x.mask_strides + 4, params.mask_strides);
  return params;
}

Binding lengths_binding(int index, Lengths& values) {
  return Binding{index, values.data(), values.size() * sizeof(int32_t), false, true};
}

// `main` followed by the optional operands' bindings: the lengths, then buffers 16-20, 23, 25
// and 26.
std::vector<Binding> with_optional(std::initializer_list<Binding> main, OptionalOperands& x) {
  std::vector<Binding> all;
  all.reserve(main.size() + 2 + x.feature_count);  // one allocation, not one per growth
  all.insert(all.end(), main.begin(), main.end());
  all.push_back(lengths_binding(JFM_BUFFER_Q_LENGTHS, x.q_lengths));
  all.push_back(lengths_binding(JFM_BUFFER_KV_LENGTHS, x.kv_lengths));
  all.insert(all.end(), x.features.begin(), x.features.begin() + x.feature_count);
  return all;
}

// The call's plan, from this thread's plan cache (plan_cache.h).
CallPlan& plan_of(Device& device, bool backward, const Problem& p) {
  PlanKey key;
  key.device = &device;
  key.dtype_suffix = p.suffix;
  key.backward = backward;
  key.dropout = p.dropout;
  key.variant = p.variant;
  key.gpu_cores = device.gpu_cores();
  key.batch = p.batch;
  key.q_len = p.q_len;
  key.kv_len = p.kv_len;
  key.heads = p.heads;
  key.kv_heads = p.kv_heads;
  key.head_dim = p.head_dim;
  key.value_head_dim = p.value_head_dim;
  return cached_plan(key, submission_budget(device));
}

int64_t splits_of(const Problem& p, int gpu_cores) {
  return decode_splits(p.suffix, p.batch, p.q_len, p.kv_len, p.heads, p.kv_heads,
                       tile_head_dim(p.head_dim, p.value_head_dim), gpu_cores, p.dropout);
}

// The plan's kernels on the device, checked once per cached plan.
ffi::Error require_kernels(Device& device, CallPlan* plan, const Problem& p) {
  if (plan->kernels_found) return ffi::Error::Success();
  for (const StageShape& stage : plan->stages) {
    if (ffi::Error e = require_kernel(device, stage.kernel, p); e.failure()) return e;
  }
  plan->kernels_found = true;
  return ffi::Error::Success();
}

// One handler call from validation until the device reports: the optional operands' host
// arrays, which the bindings point into (so they stay in place until the run has finished), the
// submissions, the promise behind the future the handler returns, and its host-path timer.
struct PendingCall {
  OptionalOperands x;
  std::vector<Submission> submissions;
  ffi::Promise promise;
  HostTimer timer;
};

static_assert(sizeof(AttentionParams) <= kMaxConstantBytes,
              "a dispatch holds its AttentionParams in place (device.h ConstantBytes)");

// Appends to call->submissions the stages in the submissions of the dispatch plan, each chunk
// with its offsets in AttentionParams: the first stage binds `first`, every later one `later`
// (the decode's combine; the backward's dK/dV kernels), moved into the last dispatch that binds
// them and copied into the others.
void plan_stages(const Problem& p, const Attributes& o, const CallPlan& plan,
                 std::vector<Binding> first, std::vector<Binding> later, PendingCall* call,
                 int64_t splits = 0) {
  const std::vector<StageShape>& stages = plan.stages;
  size_t uses[2] = {0, 0};  // the dispatches still to bind `first` and `later`
  for (const ChunkedSubmission& chunks : plan.submissions) {
    for (const Chunk& chunk : chunks) ++uses[chunk.stage == 0 ? 0 : 1];
  }
  AttentionParams base = make_params(p, o, call->x);
  base.splits = static_cast<uint32_t>(splits);
  call->submissions.reserve(plan.submissions.size());
  for (const ChunkedSubmission& chunks : plan.submissions) {
    Submission submission;
    submission.reserve(chunks.size());
    for (const Chunk& chunk : chunks) {
      const StageShape& stage = stages[chunk.stage];
      AttentionParams params = base;
      params.block_offset = chunk.offset[0];
      params.head_offset = chunk.offset[1];
      params.batch_offset = chunk.offset[2];
      Dispatch d;
      d.kernel = stage.kernel;
      d.groups = chunk.groups;
      d.group_size = {stage.threads, 1, 1};
      const int kind = chunk.stage == 0 ? 0 : 1;
      std::vector<Binding>& bindings = kind == 0 ? first : later;
      if (--uses[kind] == 0) {
        d.buffers = std::move(bindings);
      } else {
        d.buffers = bindings;
      }
      d.constants.assign(&params, sizeof(AttentionParams));  // fits: static_assert above
      d.constants_index = JFM_BUFFER_PARAMS;
      d.function_constants = jfm_function_constants(params) & stage.function_constant_mask;
      d.multiply_adds = chunk.multiply_adds;
      submission.push_back(std::move(d));
    }
    mark_barriers(&submission);
    call->submissions.push_back(std::move(submission));
  }
  call->timer.lap(kHostPlan);
}

// The future of a call that finished (or failed) before reaching the device.
ffi::Future finished(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.failure()) {
    promise.SetError(std::move(error));
  } else {
    promise.SetAvailable();
  }
  return future;
}

// The host memory the call holds for the kernels' arguments (working_memory.h): its
// parameter blocks and copied lengths, as allocated.
uint64_t argument_bytes_held(const PendingCall& call) {
  uint64_t bytes = (call.x.q_lengths.size() + call.x.kv_lengths.size()) * sizeof(int32_t);
  for (const Submission& submission : call.submissions) {
    for (const Dispatch& d : submission) bytes += d.constants.size();
  }
  return bytes;
}

// Starts the call's submissions on the device; the future completes when the device reports
// (a device error becomes an FFI error, naming the kernel as the device's message does).
ffi::Future launch(Device& device, std::shared_ptr<PendingCall> call) {
  if (call->submissions.empty()) return finished(ffi::Error::Success());
  ffi::Future future(call->promise);
  record_argument_bytes(argument_bytes_held(*call));
  const char* kind = device.kind();
  std::vector<Submission> submissions = std::move(call->submissions);
  device.run_async(std::move(submissions), [call, kind](const std::string& error) {
    if (error.empty()) {
      call->promise.SetAvailable();
    } else {
      call->promise.SetError(ffi::Error(
          ffi::ErrorCode::kInternal,
          std::string("jax_flash_metal: ") + kind + " device error: " + error));
    }
  });
  call->timer.lap(kHostLaunch);
  call->timer.finish();
  return future;
}

ffi::Error unavailable(const std::string& why) {
  return ffi::Error(ffi::ErrorCode::kUnavailable, "jax_flash_metal: " + why);
}

void zero(ffi::AnyBuffer buffer) {
  if (buffer.size_bytes()) std::memset(buffer.untyped_data(), 0, buffer.size_bytes());
}

// The forward's results when no key exists (kv_len 0), as the kernels write an empty row: O = 0,
// LSE = -inf, residuals m = JFM_EMPTY_ROW_MAX and log(l) = 0; with sinks a row that saw only its
// sink (jfm_fold_sink): m = LSE = the sink, log(l) = 0.
void write_empty_rows(const Problem& p, const float* sinks, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                      ffi::AnyBuffer row_max, ffi::AnyBuffer log_sum) {
  zero(o);
  zero(log_sum);
  float* lse_row = static_cast<float*>(lse.untyped_data());
  float* max_row = static_cast<float*>(row_max.untyped_data());
  for (int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const float sink = sinks ? sinks[bh % p.heads] : 0.0f;
    std::fill(max_row + bh * p.q_len, max_row + (bh + 1) * p.q_len,
              sinks ? sink : JFM_EMPTY_ROW_MAX);
    std::fill(lse_row + bh * p.q_len, lse_row + (bh + 1) * p.q_len,
              sinks ? sink : -std::numeric_limits<float>::infinity());
  }
}

// Validates a forward call and plans it into call->submissions (none when nothing is to run).
ffi::Error forward(Device* device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::RemainingArgs rest, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                   ffi::AnyBuffer row_max, ffi::AnyBuffer log_sum, ffi::AnyBuffer workspace,
                   const Attributes& opt, PendingCall* call) {
  Problem p;
  if (ffi::Error e = read_problem(q, k, v, opt.has_page_table, &p); e.failure()) return e;
  if (ffi::Error e = check_attributes(opt); e.failure()) return e;
  p.dropout = opt.dropout_rate > 0.0;
  p.variant = opt.kernel_variant;
  if (opt.has_page_table) {
    if (ffi::Error e = read_page_table(rest, opt, &p); e.failure()) return e;
  }
  if (ffi::Error e = expect("output o", o, p.dtype, p.o_shape()); e.failure()) return e;
  for (auto [what, buffer] :
       {std::make_pair("output lse", lse), std::make_pair("output row_max", row_max),
        std::make_pair("output log_sum", log_sum)}) {
    if (ffi::Error e = expect(what, buffer, ffi::DataType::F32, p.row_shape()); e.failure()) {
      return e;
    }
  }
  const int64_t splits = splits_of(p, device->gpu_cores());
  if (ffi::Error e = expect("workspace", workspace, ffi::DataType::F32,
                            {decode_workspace_elements(p.batch, p.q_len, p.heads,
                                                       p.value_head_dim, splits)});
      e.failure()) {
    return e;
  }
  OptionalOperands& x = call->x;
  if (ffi::Error e = read_optional(rest, opt, p, &x); e.failure()) return e;
  call->timer.lap(kHostValidate);

  if (p.batch == 0 || p.q_len == 0 || p.heads == 0) return ffi::Error::Success();  // empty
  if (p.kv_len == 0) {  // no key is visible anywhere
    write_empty_rows(p, x.sinks, o, lse, row_max, log_sum);
    return ffi::Error::Success();
  }
  CallPlan& plan = plan_of(*device, false, p);
  call->timer.lap(kHostPlan);
  if (ffi::Error e = require_kernels(*device, &plan, p); e.failure()) return e;
  call->timer.lap(kHostLookup);
  const Binding bq = whole(JFM_BUFFER_Q, q, false), bk = whole(JFM_BUFFER_K, k, false),
                bv = whole(JFM_BUFFER_V, v, false), bo = whole(JFM_BUFFER_O, o, true),
                blse = whole(JFM_BUFFER_LSE, lse, true),
                bmax = whole(JFM_BUFFER_ROW_MAX, row_max, true),
                bsum = whole(JFM_BUFFER_LOG_SUM, log_sum, true);
  if (splits == 0) {
    plan_stages(p, opt, plan, with_optional({bq, bk, bv, bo, blse, bmax, bsum}, x), {}, call);
    return ffi::Error::Success();
  }
  // Decode: pass 1 writes the workspace that pass 2 combines (with the sinks).
  plan_stages(
      p, opt, plan, with_optional({bq, bk, bv, whole(JFM_BUFFER_WORKSPACE, workspace, true)}, x),
      with_optional({whole(JFM_BUFFER_WORKSPACE, workspace, false), bo, blse, bmax, bsum}, x),
      call, splits);
  return ffi::Error::Success();
}

// Validates a backward call and plans it into call->submissions (none when nothing is to run).
ffi::Error backward(Device* device, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::AnyBuffer o, ffi::AnyBuffer row_max, ffi::AnyBuffer log_sum,
                    ffi::AnyBuffer d_o, ffi::AnyBuffer g_lse, ffi::RemainingArgs rest,
                    ffi::AnyBuffer dq,
                    ffi::AnyBuffer dk, ffi::AnyBuffer dv, ffi::AnyBuffer dbias,
                    ffi::AnyBuffer dalibi, ffi::AnyBuffer delta, const Attributes& opt,
                    PendingCall* call) {
  if (opt.has_page_table) {
    return invalid("a paged K/V cache (has_page_table) has no backward: the forward only");
  }
  Problem p;
  if (ffi::Error e = read_problem(q, k, v, false, &p); e.failure()) return e;
  if (ffi::Error e = check_attributes(opt); e.failure()) return e;
  p.dropout = opt.dropout_rate > 0.0;
  p.variant = opt.kernel_variant;
  const ffi::DataType f32 = ffi::DataType::F32;
  for (auto [what, buffer, dtype, shape] :
       {std::make_tuple("o", o, p.dtype, p.o_shape()),
        std::make_tuple("row_max", row_max, f32, p.row_shape()),
        std::make_tuple("log_sum", log_sum, f32, p.row_shape()),
        std::make_tuple("do", d_o, p.dtype, p.o_shape()),
        std::make_tuple("g_lse", g_lse, f32, p.row_shape()),
        std::make_tuple("output dq", dq, p.dtype, p.q_shape()),
        std::make_tuple("output dk", dk, p.dtype, p.k_shape()),
        std::make_tuple("output dv", dv, p.dtype, p.v_shape()),
        std::make_tuple("output dbias", dbias, f32, dbias_shape(p, opt.bias_grad)),
        std::make_tuple("output dalibi", dalibi, f32, dalibi_shape(p, opt.alibi_grad)),
        std::make_tuple("workspace delta", delta, f32, p.row_shape())}) {
    if (ffi::Error e = expect(what, buffer, dtype, shape); e.failure()) return e;
  }
  OptionalOperands& x = call->x;
  if (ffi::Error e = read_optional(rest, opt, p, &x); e.failure()) return e;
  call->timer.lap(kHostValidate);

  if (p.batch == 0 || p.heads == 0) return ffi::Error::Success();  // every output is empty
  if (p.q_len == 0 || p.kv_len == 0) {  // no query sees any key: all gradients are zero
    zero(dq);
    zero(dk);
    zero(dv);
    zero(dbias);
    zero(dalibi);
    return ffi::Error::Success();
  }
  CallPlan& plan = plan_of(*device, true, p);
  call->timer.lap(kHostPlan);
  if (ffi::Error e = require_kernels(*device, &plan, p); e.failure()) return e;
  call->timer.lap(kHostLookup);
  const Binding bq = whole(JFM_BUFFER_Q, q, false), bk = whole(JFM_BUFFER_K, k, false),
                bv = whole(JFM_BUFFER_V, v, false), bdo = whole(JFM_BUFFER_DO, d_o, false),
                bmax = whole(JFM_BUFFER_ROW_MAX, row_max, false),
                bsum = whole(JFM_BUFFER_LOG_SUM, log_sum, false);
  // dQ first: it also writes delta, which the dK/dV kernels (one, or the split pair) read,
  // with bias_grad every element of dbias and with alibi_grad every row of dalibi (else a
  // placeholder it never touches is bound).
  const Binding bdbias =
      opt.bias_grad ? whole(JFM_BUFFER_DBIAS, dbias, true) : x.unused(JFM_BUFFER_DBIAS);
  const Binding bdalibi =
      opt.alibi_grad ? whole(JFM_BUFFER_DALIBI, dalibi, true) : x.unused(JFM_BUFFER_DALIBI);
  plan_stages(p, opt, plan,
              with_optional({bq, bk, bv, bmax, bsum, bdo, whole(JFM_BUFFER_O, o, false),
                             whole(JFM_BUFFER_G_LSE, g_lse, false),
                             whole(JFM_BUFFER_DELTA, delta, true), whole(JFM_BUFFER_DQ, dq, true),
                             bdbias, bdalibi},
                            x),
              with_optional({bq, bk, bv, bmax, bsum, bdo, whole(JFM_BUFFER_DELTA, delta, false),
                             whole(JFM_BUFFER_DK, dk, true), whole(JFM_BUFFER_DV, dv, true)},
                            x),
              call);
  return ffi::Error::Success();
}

// Handler bodies, one per (direction, device); the device getter is a template argument so the
// same validation and plan serve both devices. Each validates and plans on XLA's thread, starts
// the device and returns a future the device completes (asynchronous FFI handlers: XLA:CPU runs
// independent work of the program meanwhile), or an already failed one for invalid input.
template <Device* (*GetDevice)(std::string*)>
ffi::Future forward_handler(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> lse, ffi::Result<ffi::AnyBuffer> row_max,
                           ffi::Result<ffi::AnyBuffer> log_sum,
                           ffi::Result<ffi::AnyBuffer> workspace, Attributes attributes) {
  if (attributes.bias_grad || attributes.alibi_grad) {
    return finished(invalid("bias_grad and alibi_grad are the backward's attributes (the "
                            "forward has no dbias or dalibi result)"));
  }
  std::string why;
  Device* device = GetDevice(&why);
  if (device == nullptr) return finished(unavailable(why));
  auto call = std::make_shared<PendingCall>();
  if (ffi::Error e = forward(device, q, k, v, rest, *o, *lse, *row_max, *log_sum, *workspace,
                             attributes, call.get());
      e.failure()) {
    return finished(std::move(e));
  }
  return launch(*device, std::move(call));
}

template <Device* (*GetDevice)(std::string*)>
ffi::Future backward_handler(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer o, ffi::AnyBuffer row_max, ffi::AnyBuffer log_sum,
                            ffi::AnyBuffer d_o, ffi::AnyBuffer g_lse, ffi::RemainingArgs rest,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias,
                            ffi::Result<ffi::AnyBuffer> dalibi,
                            ffi::Result<ffi::AnyBuffer> delta, Attributes attributes) {
  if (attributes.bias_grad && !attributes.has_bias) {
    return finished(invalid("bias_grad needs has_bias (a bias operand)"));
  }
  if (attributes.alibi_grad && !attributes.has_alibi) {
    return finished(invalid("alibi_grad needs has_alibi (an alibi_slopes operand)"));
  }
  std::string why;
  Device* device = GetDevice(&why);
  if (device == nullptr) return finished(unavailable(why));
  auto call = std::make_shared<PendingCall>();
  if (ffi::Error e = backward(device, q, k, v, o, row_max, log_sum, d_o, g_lse, rest, *dq, *dk,
                              *dv, *dbias, *dalibi, *delta, attributes, call.get());
      e.failure()) {
    return finished(std::move(e));
  }
  return launch(*device, std::move(call));
}

auto forward_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .RemainingArgs()        // the optional operands (attention_ffi.h)
      .Ret<ffi::AnyBuffer>()  // o
      .Ret<ffi::AnyBuffer>()  // lse
      .Ret<ffi::AnyBuffer>()  // row_max
      .Ret<ffi::AnyBuffer>()  // log_sum
      .Ret<ffi::AnyBuffer>()  // workspace (decode)
      .Attrs<Attributes>();
}

auto backward_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::AnyBuffer>()  // q
      .Arg<ffi::AnyBuffer>()  // k
      .Arg<ffi::AnyBuffer>()  // v
      .Arg<ffi::AnyBuffer>()  // o
      .Arg<ffi::AnyBuffer>()  // row_max
      .Arg<ffi::AnyBuffer>()  // log_sum
      .Arg<ffi::AnyBuffer>()  // do
      .Arg<ffi::AnyBuffer>()  // g_lse
      .RemainingArgs()        // the optional operands (attention_ffi.h)
      .Ret<ffi::AnyBuffer>()  // dq
      .Ret<ffi::AnyBuffer>()  // dk
      .Ret<ffi::AnyBuffer>()  // dv
      .Ret<ffi::AnyBuffer>()  // dbias ([0] without bias_grad)
      .Ret<ffi::AnyBuffer>()  // dalibi ([0] without alibi_grad)
      .Ret<ffi::AnyBuffer>()  // delta (workspace)
      .Attrs<Attributes>();
}

Device* get_emulated_device(std::string*) { return &emulated_device(); }

#ifdef JFM_HAVE_METAL
Device* get_metal_device(std::string* why) {
  Device* device = metal_device();
  if (device == nullptr) *why = "no Metal device: " + metal_unavailable_reason();
  return device;
}
#endif

}  // namespace

}  // namespace jfm

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfmAttentionFwdEmulator,
    jfm::forward_handler<jfm::get_emulated_device>,
    jfm::forward_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JfmAttentionBwdEmulator,
    jfm::backward_handler<jfm::get_emulated_device>,
    jfm::backward_binding());
#ifdef JFM_HAVE_METAL
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfmAttentionFwdMetal,
                              jfm::forward_handler<jfm::get_metal_device>,
                              jfm::forward_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfmAttentionBwdMetal,
                              jfm::backward_handler<jfm::get_metal_device>,
                              jfm::backward_binding());
#endif
