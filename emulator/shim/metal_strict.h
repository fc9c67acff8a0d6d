// Declarations of the Metal standard library subset for the emulator's strict pass: translated
// shaders are type-checked once more against this header with clang (-fsyntax-only, C++14,
// -target aarch64-linux-gnu with bf16, no standard headers). device, constant and threadgroup are distinct
// clang address spaces, so mixing pointers of different address spaces, writing through
// `constant`, or passing device memory where thread memory is expected fails as it would with
// the Metal compiler. half is clang's _Float16 and vectors are ext_vector_type (builtin types
// work in any address space, unlike classes, whose member functions clang cannot call on
// address-space-qualified objects). bfloat is clang 14's storage-only __bf16: conversions only.
// Functions are declared permissively (templates); precise overload rules are the runtime
// shim's job.
#ifndef JAX_FLASH_METAL_EMULATOR_METAL_STRICT_H_
#define JAX_FLASH_METAL_EMULATOR_METAL_STRICT_H_

#define __METAL_VERSION__ 300
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
#define threadgroup __attribute__((address_space(3)))
#define thread
#define METAL_FUNC inline

#define JFM_TGV(name, dims, ...) static threadgroup __VA_ARGS__ name dims
namespace jfm { namespace rt { bool function_constant(int index); } }
#define JFM_FUNCTION_CONSTANT(T, N) (static_cast<T>(::jfm::rt::function_constant(N)))

#include "metal_constants.h"

typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));
#define JFM_VEC_TYPES(T, P) \
  typedef vec<T, 2> P##2;   \
  typedef vec<T, 3> P##3;   \
  typedef vec<T, 4> P##4;
JFM_VEC_TYPES(float, float)
JFM_VEC_TYPES(half, half)
JFM_VEC_TYPES(int, int)
JFM_VEC_TYPES(uint, uint)
JFM_VEC_TYPES(short, short)
JFM_VEC_TYPES(ushort, ushort)
JFM_VEC_TYPES(char, char)
JFM_VEC_TYPES(uchar, uchar)
JFM_VEC_TYPES(long, long)
JFM_VEC_TYPES(ulong, ulong)
JFM_VEC_TYPES(int, bool)  // clang has no bool vectors; comparisons yield int vectors
#undef JFM_VEC_TYPES

template <class V, class... A>
V jfm_make(A... a);
#define JFM_SWIZZLE(name, ...) name

namespace metal {

enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

template <class To, class From>
To as_type(From f);

#define JFM_UNARY(NAME) \
  template <class T>    \
  T NAME(T x);
JFM_UNARY(exp)
JFM_UNARY(exp2)
JFM_UNARY(exp10)
JFM_UNARY(log)
JFM_UNARY(log2)
JFM_UNARY(log10)
JFM_UNARY(sqrt)
JFM_UNARY(rsqrt)
JFM_UNARY(sin)
JFM_UNARY(cos)
JFM_UNARY(tan)
JFM_UNARY(tanh)
JFM_UNARY(floor)
JFM_UNARY(ceil)
JFM_UNARY(round)
JFM_UNARY(rint)
JFM_UNARY(trunc)
JFM_UNARY(fabs)
JFM_UNARY(abs)
JFM_UNARY(fract)
JFM_UNARY(saturate)
JFM_UNARY(sign)
JFM_UNARY(popcount)
#undef JFM_UNARY
#define JFM_BINARY(NAME)   \
  template <class T, class U> \
  T NAME(T x, U y);
JFM_BINARY(max)
JFM_BINARY(min)
JFM_BINARY(fmax)
JFM_BINARY(fmin)
JFM_BINARY(pow)
JFM_BINARY(powr)
JFM_BINARY(fmod)
JFM_BINARY(atan2)
JFM_BINARY(copysign)
JFM_BINARY(step)
JFM_BINARY(divide)
JFM_BINARY(mulhi)
#undef JFM_BINARY
template <class T, int N>
T dot(vec<T, N> a, vec<T, N> b);
template <class T, class L, class H>
T clamp(T x, L lo, H hi);
template <class T, class U, class V>
T fma(T a, U b, V c);
template <class T, class U, class A>
T mix(T x, U y, A a);
template <class T, class C>
T select(T a, T b, C c);
template <class T>
bool isnan(T x);
template <class T>
bool isinf(T x);
template <class T>
bool isfinite(T x);
template <class T>
bool signbit(T x);
template <class T>
bool all(T x);
template <class T>
bool any(T x);

namespace fast {
using metal::abs;
using metal::ceil;
using metal::clamp;
using metal::cos;
using metal::divide;
using metal::exp;
using metal::exp10;
using metal::exp2;
using metal::fabs;
using metal::floor;
using metal::fmax;
using metal::fmin;
using metal::log;
using metal::log10;
using metal::log2;
using metal::max;
using metal::min;
using metal::pow;
using metal::powr;
using metal::rsqrt;
using metal::saturate;
using metal::sin;
using metal::sqrt;
using metal::tan;
using metal::tanh;
}  // namespace fast
namespace precise {
using namespace fast;
}

template <class T>
struct numeric_limits {
  static constexpr T infinity();
  static constexpr T quiet_NaN();
  static constexpr T max();
  static constexpr T min();
  static constexpr T lowest();
  static constexpr T epsilon();
};

void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

#define JFM_SIMD1(NAME) \
  template <class T>    \
  T NAME(T x);
JFM_SIMD1(simd_sum)
JFM_SIMD1(simd_product)
JFM_SIMD1(simd_max)
JFM_SIMD1(simd_min)
JFM_SIMD1(simd_and)
JFM_SIMD1(simd_or)
JFM_SIMD1(simd_xor)
JFM_SIMD1(simd_prefix_inclusive_sum)
JFM_SIMD1(simd_prefix_exclusive_sum)
JFM_SIMD1(simd_broadcast_first)
#undef JFM_SIMD1
#define JFM_SIMD2(NAME) \
  template <class T>    \
  T NAME(T x, ushort v);
JFM_SIMD2(simd_shuffle)
JFM_SIMD2(simd_broadcast)
JFM_SIMD2(simd_shuffle_xor)
JFM_SIMD2(simd_shuffle_up)
JFM_SIMD2(simd_shuffle_down)
JFM_SIMD2(simd_shuffle_rotate_down)
JFM_SIMD2(simd_shuffle_rotate_up)
#undef JFM_SIMD2
bool simd_all(bool x);
bool simd_any(bool x);

template <class T, int R, int C>
struct simdgroup_matrix {
  simdgroup_matrix();
  explicit simdgroup_matrix(T diagonal);
  vec<T, 2>& thread_elements();
  const vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value);

// simdgroup_load/store exist for device, threadgroup (and constant, load only) memory.
#define JFM_MATRIX_IO(AS)                                                                    \
  template <class T, class P>                                                                \
  void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const AS P* src, ulong elements_per_row = 8, \
                      ulong2 matrix_origin = 0, bool transpose_matrix = false);               \
  template <class T, class P>                                                                \
  void simdgroup_store(simdgroup_matrix<T, 8, 8> s, AS P* dst, ulong elements_per_row = 8,   \
                       ulong2 matrix_origin = 0, bool transpose_matrix = false);
JFM_MATRIX_IO(device)
JFM_MATRIX_IO(threadgroup)
#undef JFM_MATRIX_IO
template <class T, class P>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, constant P* src, ulong elements_per_row = 8,
                    ulong2 matrix_origin = 0, bool transpose_matrix = false);
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, simdgroup_matrix<TA, 8, 8> a,
                                   simdgroup_matrix<TB, 8, 8> b, simdgroup_matrix<TC, 8, 8> c);
template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, simdgroup_matrix<TA, 8, 8> a,
                        simdgroup_matrix<TB, 8, 8> b);

enum memory_order { memory_order_relaxed };
template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
template <class T>
struct same {
  typedef T type;
};
// Atomics live in device or threadgroup memory.
#define JFM_ATOMICS(AS)                                                                        \
  template <class T>                                                                           \
  void atomic_store_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_load_explicit(volatile AS atomic<T>* obj, memory_order);                           \
  template <class T>                                                                           \
  T atomic_exchange_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_add_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_sub_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_min_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_max_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_and_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_or_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  T atomic_fetch_xor_explicit(volatile AS atomic<T>* obj, typename same<T>::type v, memory_order); \
  template <class T>                                                                           \
  bool atomic_compare_exchange_weak_explicit(volatile AS atomic<T>* obj, thread T* expected,  \
                                             typename same<T>::type desired, memory_order,     \
                                             memory_order);
JFM_ATOMICS(device)
JFM_ATOMICS(threadgroup)
#undef JFM_ATOMICS

}  // namespace metal

// Apple GPUs have no double: make any use of it a diagnostic that says so.
#define double jfm_double_is_not_supported_in_metal

#endif  // JAX_FLASH_METAL_EMULATOR_METAL_STRICT_H_
