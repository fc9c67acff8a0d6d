// The subset of the Metal Shading Language standard library that translated shaders run against
// on the CPU (the emulator's runtime build). The strict pass uses metal_strict.h instead, which
// declares the same API with clang address spaces.
//
// Semantics modelled after the MSL 3.0 specification: half is IEEE binary16 and bfloat the upper
// half of binary32, both converted with round-to-nearest-even; every half operation rounds its
// float result once (exact for + - * /, since binary32 holds twice binary16's precision plus 2
// bits); max/min/fmax/fmin return the other operand when one is NaN; unsuffixed floating literals
// are float (the translator appends `f`); metal::fast:: functions are the precise ones except for
// Inf/NaN arguments (see `namespace fast` below). Not modelled: the exact ULP error of GPU
// transcendental functions, and the order in which the GPU sums within simd_sum or
// simdgroup_multiply (we sum in lane / k order in float).
#ifndef JAX_FLASH_METAL_EMULATOR_METAL_SHIM_H_
#define JAX_FLASH_METAL_EMULATOR_METAL_SHIM_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "runtime.h"

#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 300
#endif

// The namespace this shim and the translated shader live in: global for the normal build; the
// counting build (JFM_COUNTING, see emulator/README.md) includes both inside
// `namespace jfm_counting` so its instrumented inline functions never merge with the normal ones.
#ifndef JFM_ROOT
#define JFM_ROOT
#endif

// Address spaces are plain memory on the CPU; the strict pass checks them.
#define device
#define constant
#define threadgroup
#define thread
#define METAL_FUNC inline

// A `threadgroup` variable declared in a kernel body (rewritten by the translator): a reference
// into the group's threadgroup memory, one block per declaration site.
#define JFM_TGV(name, dims, ...)                                                       \
  static char name##_jfm_tg_site;                                                      \
  __VA_ARGS__(&name) dims = *static_cast<__VA_ARGS__(*) dims>(                         \
      ::jfm::rt::threadgroup_alloc(&name##_jfm_tg_site, sizeof(__VA_ARGS__ dims),      \
                                   alignof(__VA_ARGS__ dims), sizeof(__VA_ARGS__), #name, \
                                   __FILE__, __LINE__))

#include "metal_constants.h"

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;  // 64-bit, as in Metal (LP64 hosts only)
static_assert(sizeof(long) == 8, "Metal's long is 64-bit");

namespace jfm {
namespace shim {

template <class To, class From>
inline To bitcast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of equal size");
  To t;
  __builtin_memcpy(&t, &f, sizeof(To));
  return t;
}

#if defined(__F16C__) && defined(__x86_64__)
// x86 F16C (enabled by the build when the CPU has it): same results as the portable code below,
// round to nearest even, NaN quieted with its payload's upper bits kept.
typedef float jfm_v4sf __attribute__((vector_size(16)));
typedef short jfm_v8hi __attribute__((vector_size(16)));
inline uint16_t f32_to_f16(float f) {
  jfm_v4sf v = {f, 0.0f, 0.0f, 0.0f};
  return uint16_t(__builtin_ia32_vcvtps2ph(v, 0)[0]);
}
inline float f16_to_f32(uint16_t h) {
  jfm_v8hi v = {short(h), 0, 0, 0, 0, 0, 0, 0};
  return __builtin_ia32_vcvtph2ps(v)[0];
}
#else
// binary32 -> binary16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_f16(float f) {
  uint32_t x = bitcast<uint32_t>(f);
  uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | (x > 0x7f800000u ? uint16_t(0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (x < 0x38800000u) {                        // below 2^-14: subnormal, in units of 2^-24
    float scaled = bitcast<float>(x) * 16777216.0f;  // exact
    return sign | uint16_t(__builtin_rintf(scaled));  // default rounding mode: nearest even
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return sign | uint16_t((x - 0x38000000u) >> 13);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 0x1f) return bitcast<float>(sign | 0x7f800000u | (m << 13));
  return bitcast<float>(sign | ((e + 112u) << 23) | (m << 13));
}
#endif

inline uint16_t f32_to_bf16(float f) {
  uint32_t x = bitcast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float bf16_to_f32(uint16_t b) { return bitcast<float>(uint32_t(b) << 16); }

}  // namespace shim
}  // namespace jfm

// Both 16-bit float types share one implementation: storage bits plus conversions.
#define JFM_DEFINE_F16_TYPE(NAME, TO_BITS, FROM_BITS)                                          \
  struct NAME {                                                                                \
    uint16_t bits;                                                                             \
    NAME() = default;                                                                          \
    NAME(float f) : bits(JFM_ROOT::jfm::shim::TO_BITS(f)) {}                                       \
    template <class T, typename std::enable_if<std::is_arithmetic<T>::value &&                 \
                                                   !std::is_same<T, float>::value,             \
                                               int>::type = 0>                                 \
    NAME(T v) : bits(JFM_ROOT::jfm::shim::TO_BITS(float(v))) {}                                    \
    operator float() const { return JFM_ROOT::jfm::shim::FROM_BITS(bits); }                        \
    static NAME from_bits(uint16_t b) {                                                        \
      NAME r;                                                                                  \
      r.bits = b;                                                                              \
      return r;                                                                                \
    }                                                                                          \
  };                                                                                           \
  inline NAME operator-(NAME a) { return NAME::from_bits(uint16_t(a.bits ^ 0x8000u)); }        \
  inline NAME operator+(NAME a) { return a; }

JFM_DEFINE_F16_TYPE(half, f32_to_f16, f16_to_f32)
JFM_DEFINE_F16_TYPE(bfloat, f32_to_bf16, bf16_to_f32)
#undef JFM_DEFINE_F16_TYPE

namespace jfm {
namespace shim {
template <class T>
struct is_f16 : std::integral_constant<bool, std::is_same<T, half>::value ||
                                                 std::is_same<T, bfloat>::value> {};
template <class T>
struct is_scalar
    : std::integral_constant<bool, std::is_arithmetic<T>::value || is_f16<T>::value> {};
template <class T>
using enable_integral = typename std::enable_if<std::is_integral<T>::value, int>::type;
}  // namespace shim
}  // namespace jfm

// half/bfloat op half/bfloat -> same type (rounded once); with float -> float; with an integer ->
// the 16-bit type; comparisons in float.
#define JFM_F16_BINOP(H, OP)                                                                 \
  inline H operator OP(H a, H b) { return H(float(a) OP float(b)); }                         \
  inline float operator OP(H a, float b) { return float(a) OP b; }                           \
  inline float operator OP(float a, H b) { return a OP float(b); }                           \
  inline float operator OP(H a, double b) { return float(a) OP float(b); }                   \
  inline float operator OP(double a, H b) { return float(a) OP float(b); }                   \
  template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>                                  \
  inline H operator OP(H a, I b) { return H(float(a) OP float(b)); }                         \
  template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>                                  \
  inline H operator OP(I a, H b) { return H(float(a) OP float(b)); }                         \
  template <class U>                                                                          \
  inline H& operator OP##=(H & a, U b) { return a = H(a OP b); }
#define JFM_F16_CMP(H, OP)                                                                   \
  inline bool operator OP(H a, H b) { return float(a) OP float(b); }                         \
  inline bool operator OP(H a, float b) { return float(a) OP b; }                            \
  inline bool operator OP(float a, H b) { return a OP float(b); }                            \
  inline bool operator OP(H a, double b) { return float(a) OP float(b); }                    \
  inline bool operator OP(double a, H b) { return float(a) OP float(b); }                    \
  template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>                                  \
  inline bool operator OP(H a, I b) { return float(a) OP float(b); }                         \
  template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>                                  \
  inline bool operator OP(I a, H b) { return float(a) OP float(b); }
#define JFM_F16_OPS(H)                                                                       \
  JFM_F16_BINOP(H, +) JFM_F16_BINOP(H, -) JFM_F16_BINOP(H, *) JFM_F16_BINOP(H, /)           \
  JFM_F16_CMP(H, <) JFM_F16_CMP(H, <=) JFM_F16_CMP(H, >) JFM_F16_CMP(H, >=)                 \
  JFM_F16_CMP(H, ==) JFM_F16_CMP(H, !=)
JFM_F16_OPS(half)
JFM_F16_OPS(bfloat)
#undef JFM_F16_OPS
#undef JFM_F16_CMP
#undef JFM_F16_BINOP

// vec<T, N>: Metal vectors. 3-vectors are padded and aligned like 4-vectors, as in Metal.
// Components are .x .y .z .w and [i]; swizzles through jfm_swizzle_ref below.
template <class T, int N>
struct jfm_vec_base;
template <class T>
struct alignas(2 * sizeof(T)) jfm_vec_base<T, 2> {
  T x, y;
};
template <class T>
struct alignas(4 * sizeof(T)) jfm_vec_base<T, 3> {
  T x, y, z;
};
template <class T>
struct alignas(4 * sizeof(T)) jfm_vec_base<T, 4> {
  T x, y, z, w;
};

template <class T, int N>
struct vec;

namespace jfm {
namespace shim {
// Vectors and swizzle references (which derive from vectors) expose their vector type.
template <class U, class = void>
struct vector_of {
  typedef void type;
};
template <class U>
struct vector_of<U, decltype(void(sizeof(typename U::jfm_vec_type)))> {
  typedef typename U::jfm_vec_type type;
};
template <class U>
struct is_vector : std::integral_constant<bool, !std::is_void<typename vector_of<U>::type>::value> {};
template <class U, bool = is_vector<U>::value>
struct ncomp : std::integral_constant<int, 1> {};
template <class U>
struct ncomp<U, true> : std::integral_constant<int, vector_of<U>::type::size> {};
// The value type of an operand: a swizzle reference decays to its vector.
template <class U, bool = is_vector<U>::value>
struct value_of {
  typedef U type;
};
template <class U>
struct value_of<U, true> {
  typedef typename vector_of<U>::type type;
};
}  // namespace shim
}  // namespace jfm

template <class T, int N, int... I>
struct jfm_swizzle_ref;

template <class T, int N>
struct vec : jfm_vec_base<T, N> {
  typedef vec jfm_vec_type;
  static constexpr int size = N;
  vec() = default;
  template <class U, typename std::enable_if<jfm::shim::is_scalar<U>::value, int>::type = 0>
  vec(U s) {  // broadcast, implicit as in Metal
    for (int i = 0; i < N; ++i) (*this)[i] = T(s);
  }
  template <class U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = T(o[i]);
  }
  template <class A, class B, class... R>
  vec(const A& a, const B& b, const R&... r) {
    static_assert(jfm::shim::ncomp<A>::value + jfm::shim::ncomp<B>::value +
                          (0 + ... + jfm::shim::ncomp<R>::value) ==
                      N,
                  "vector constructor needs exactly N components");
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, r), ...);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }

  // Swizzles: the translator rewrites v.xy into v.template swizzle<0, 1>() (JFM_SWIZZLE).
  template <int... I>
  jfm_swizzle_ref<T, N, I...> swizzle() {
    return jfm_swizzle_ref<T, N, I...>(this);
  }
  template <int... I>
  vec<T, sizeof...(I)> swizzle() const {
    vec<T, sizeof...(I)> r;
    int k = 0;
    ((r[k++] = (*this)[I]), ...);
    return r;
  }

 private:
  template <class U>
  void put(int& k, const U& s) {
    if constexpr (jfm::shim::is_vector<U>::value) {
      const typename JFM_ROOT::jfm::shim::vector_of<U>::type& v = s;
      for (int j = 0; j < v.size; ++j) (*this)[k++] = T(v[j]);
    } else {
      (*this)[k++] = T(s);
    }
  }
};

// A swizzle of a non-const vector: holds the selected components (it is a vec<T, M>) and writes
// assignments back to the source vector's components.
template <class T, int N, int... I>
struct jfm_swizzle_ref : vec<T, sizeof...(I)> {
  typedef vec<T, sizeof...(I)> base;
  explicit jfm_swizzle_ref(vec<T, N>* s) : src(s) {
    int k = 0;
    (((*this)[k++] = (*s)[I]), ...);
  }
  jfm_swizzle_ref(const jfm_swizzle_ref&) = default;
  jfm_swizzle_ref& operator=(const base& v) {
    int k = 0;
    (((*src)[I] = v[k++]), ...);
    static_cast<base&>(*this) = v;
    return *this;
  }
  jfm_swizzle_ref& operator=(const jfm_swizzle_ref& o) {
    return *this = static_cast<const base&>(o);
  }
  template <class U>
  jfm_swizzle_ref& operator+=(const U& b) {
    return *this = base(static_cast<const base&>(*this) + b);
  }
  template <class U>
  jfm_swizzle_ref& operator-=(const U& b) {
    return *this = base(static_cast<const base&>(*this) - b);
  }
  template <class U>
  jfm_swizzle_ref& operator*=(const U& b) {
    return *this = base(static_cast<const base&>(*this) * b);
  }
  template <class U>
  jfm_swizzle_ref& operator/=(const U& b) {
    return *this = base(static_cast<const base&>(*this) / b);
  }
  vec<T, N>* src;
};
#define JFM_SWIZZLE(name, ...) template swizzle<__VA_ARGS__>()

#define JFM_VEC_TYPES(T, P) \
  typedef vec<T, 2> P##2;   \
  typedef vec<T, 3> P##3;   \
  typedef vec<T, 4> P##4;
JFM_VEC_TYPES(float, float)
JFM_VEC_TYPES(half, half)
JFM_VEC_TYPES(bfloat, bfloat)
JFM_VEC_TYPES(int, int)
JFM_VEC_TYPES(uint, uint)
JFM_VEC_TYPES(short, short)
JFM_VEC_TYPES(ushort, ushort)
JFM_VEC_TYPES(char, char)
JFM_VEC_TYPES(uchar, uchar)
JFM_VEC_TYPES(long, long)
JFM_VEC_TYPES(ulong, ulong)
JFM_VEC_TYPES(bool, bool)
#undef JFM_VEC_TYPES

// The translator rewrites `float4(a, b)` into `jfm_make<float4>(a, b)` (the strict pass needs a
// call there: clang's builtin vectors have no functional-cast constructors).
template <class V, class... A>
inline V jfm_make(const A&... a) {
  return V(a...);
}

#define JFM_VEC_BINOP(OP)                                                                 \
  template <class T, int N>                                                               \
  inline vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {                  \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP b[i]);                                   \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class U,                                                      \
            typename std::enable_if<jfm::shim::is_scalar<U>::value, int>::type = 0>       \
  inline vec<T, N> operator OP(const vec<T, N>& a, U b) {                                 \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = T(a[i] OP T(b));                                   \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class U,                                                      \
            typename std::enable_if<jfm::shim::is_scalar<U>::value, int>::type = 0>       \
  inline vec<T, N> operator OP(U a, const vec<T, N>& b) {                                 \
    vec<T, N> r;                                                                          \
    for (int i = 0; i < N; ++i) r[i] = T(T(a) OP b[i]);                                   \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class U>                                                      \
  inline vec<T, N>& operator OP##=(vec<T, N>& a, const U& b) {                            \
    return a = a OP b;                                                                    \
  }
JFM_VEC_BINOP(+)
JFM_VEC_BINOP(-)
JFM_VEC_BINOP(*)
JFM_VEC_BINOP(/)
JFM_VEC_BINOP(%)
JFM_VEC_BINOP(&)
JFM_VEC_BINOP(|)
JFM_VEC_BINOP(^)
JFM_VEC_BINOP(<<)
JFM_VEC_BINOP(>>)
#undef JFM_VEC_BINOP

#define JFM_VEC_CMP(OP)                                                                   \
  template <class T, int N>                                                               \
  inline vec<bool, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) {               \
    vec<bool, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP b[i];                                      \
    return r;                                                                             \
  }                                                                                       \
  template <class T, int N, class U,                                                      \
            typename std::enable_if<jfm::shim::is_scalar<U>::value, int>::type = 0>       \
  inline vec<bool, N> operator OP(const vec<T, N>& a, U b) {                              \
    vec<bool, N> r;                                                                       \
    for (int i = 0; i < N; ++i) r[i] = a[i] OP T(b);                                      \
    return r;                                                                             \
  }
JFM_VEC_CMP(<)
JFM_VEC_CMP(<=)
JFM_VEC_CMP(>)
JFM_VEC_CMP(>=)
JFM_VEC_CMP(==)
JFM_VEC_CMP(!=)
#undef JFM_VEC_CMP

template <class T, int N>
inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = -a[i];
  return r;
}
template <int N>
inline vec<bool, N> operator!(const vec<bool, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = !a[i];
  return r;
}

namespace metal {

using JFM_ROOT::bfloat;
using JFM_ROOT::half;
using JFM_ROOT::uchar;
using JFM_ROOT::uint;
using JFM_ROOT::ulong;
using JFM_ROOT::ushort;
using JFM_ROOT::vec;

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
inline To as_type(const From& f) {
  return JFM_ROOT::jfm::shim::bitcast<To>(typename JFM_ROOT::jfm::shim::value_of<From>::type(f));
}

// ---- math -------------------------------------------------------------------------------------
// The counting variant counts every scalar fma (the kernels' scalar dot products and axpys:
// the profile's "executed matmul FLOPs" next to simdgroup_matrix operations) and every other
// scalar call of the float math functions below (exp, exp2, log, tanh, ..., max, min, fmax,
// fmin, clamp as max and min; their fast:: and precise:: forms once), per thread. Operators
// (+ - * /, comparisons) and conversions are not calls and are not counted.
// A use of bool [[function_constant(N)]] (the translator's rewrite): the launch's value.
#define JFM_FUNCTION_CONSTANT(T, N) (static_cast<T>(::jfm::rt::function_constant(N)))

#ifdef JFM_COUNTING
#define JFM_COUNT_FMA() ::jfm::rt::count_fma()
#define JFM_COUNT_MATH() ::jfm::rt::count_math()
#else
#define JFM_COUNT_FMA() ((void)0)
#define JFM_COUNT_MATH() ((void)0)
#endif
#define JFM_UNARY_COUNTED(NAME, EXPR, COUNT)                         \
  inline float NAME(float x) {                                       \
    COUNT;                                                           \
    return EXPR;                                                     \
  }                                                                  \
  inline half NAME(half h) {                                         \
    COUNT;                                                           \
    float x = float(h);                                              \
    return half(EXPR);                                               \
  }                                                                  \
  template <class T, int N>                                          \
  inline vec<T, N> NAME(const vec<T, N>& v) {                        \
    vec<T, N> r;                                                     \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);                   \
    return r;                                                        \
  }
#define JFM_UNARY(NAME, EXPR) JFM_UNARY_COUNTED(NAME, EXPR, JFM_COUNT_MATH())
JFM_UNARY(exp, __builtin_expf(x))
JFM_UNARY(exp2, __builtin_exp2f(x))
JFM_UNARY(exp10, __builtin_powf(10.0f, x))
JFM_UNARY(log, __builtin_logf(x))
JFM_UNARY(log2, __builtin_log2f(x))
JFM_UNARY(log10, __builtin_log10f(x))
JFM_UNARY(sqrt, __builtin_sqrtf(x))
JFM_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
JFM_UNARY(sin, __builtin_sinf(x))
JFM_UNARY(cos, __builtin_cosf(x))
JFM_UNARY(tan, __builtin_tanf(x))
JFM_UNARY(tanh, __builtin_tanhf(x))
JFM_UNARY(floor, __builtin_floorf(x))
JFM_UNARY(ceil, __builtin_ceilf(x))
JFM_UNARY(round, __builtin_roundf(x))
JFM_UNARY(rint, __builtin_rintf(x))
JFM_UNARY(trunc, __builtin_truncf(x))
JFM_UNARY(fabs, __builtin_fabsf(x))
JFM_UNARY(abs, __builtin_fabsf(x))
JFM_UNARY(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
JFM_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
JFM_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x == x ? x : 0.0f)))

#define JFM_BINARY(NAME, EXPR)                                                   \
  inline float NAME(float x, float y) {                                          \
    JFM_COUNT_MATH();                                                            \
    return EXPR;                                                                 \
  }                                                                              \
  inline half NAME(half hx, half hy) {                                           \
    JFM_COUNT_MATH();                                                            \
    float x = float(hx), y = float(hy);                                          \
    return half(EXPR);                                                           \
  }                                                                              \
  inline float NAME(half hx, float y) {                                          \
    JFM_COUNT_MATH();                                                            \
    float x = float(hx);                                                         \
    return EXPR;                                                                 \
  }                                                                              \
  inline float NAME(float x, half hy) {                                          \
    JFM_COUNT_MATH();                                                            \
    float y = float(hy);                                                         \
    return EXPR;                                                                 \
  }                                                                              \
  template <class T, int N>                                                      \
  inline vec<T, N> NAME(const vec<T, N>& a, const vec<T, N>& b) {                \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b[i]);                         \
    return r;                                                                    \
  }                                                                              \
  template <class T, int N>                                                      \
  inline vec<T, N> NAME(const vec<T, N>& a, T b) {                               \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = NAME(a[i], b);                            \
    return r;                                                                    \
  }
// Metal's max/min, like fmax/fmin, return the other operand when one is NaN.
JFM_BINARY(max, __builtin_fmaxf(x, y))
JFM_BINARY(min, __builtin_fminf(x, y))
JFM_BINARY(fmax, __builtin_fmaxf(x, y))
JFM_BINARY(fmin, __builtin_fminf(x, y))
JFM_BINARY(pow, __builtin_powf(x, y))
JFM_BINARY(powr, __builtin_powf(x, y))
JFM_BINARY(fmod, __builtin_fmodf(x, y))
JFM_BINARY(atan2, __builtin_atan2f(x, y))
JFM_BINARY(copysign, __builtin_copysignf(x, y))
JFM_BINARY(step, y < x ? 0.0f : 1.0f)
#undef JFM_BINARY

// Integer max/min/abs/clamp.
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I max(I a, I b) {
  return a > b ? a : b;
}
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I min(I a, I b) {
  return a < b ? a : b;
}
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I abs(I a) {
  return a < 0 ? I(-a) : a;
}
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I clamp(I x, I lo, I hi) {
  return min(max(x, lo), hi);
}
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I popcount(I x) {
  return I(__builtin_popcountll((unsigned long long)(typename std::make_unsigned<I>::type)(x)));
}

// MSL's mulhi: the high half of the double-width product x * y (signed or unsigned as I).
template <class I, JFM_ROOT::jfm::shim::enable_integral<I> = 0>
inline I mulhi(I x, I y) {
  typedef typename std::conditional<std::is_signed<I>::value, __int128, unsigned __int128>::type
      Wide;
  return I((Wide(x) * Wide(y)) >> (8 * sizeof(I)));
}

inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }
template <class T, int N, class L>
inline vec<T, N> clamp(const vec<T, N>& x, const L& lo, const L& hi) {
  return min(max(x, lo), hi);
}
inline float fma(float a, float b, float c) {
  JFM_COUNT_FMA();
  return __builtin_fmaf(a, b, c);
}
inline half fma(half a, half b, half c) {
  JFM_COUNT_FMA();
  return half(__builtin_fma(double(float(a)), double(float(b)), double(float(c))));
}
template <class T, int N>
inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
inline float mix(float x, float y, float a) { return x + (y - x) * a; }
inline half mix(half x, half y, half a) { return half(mix(float(x), float(y), float(a))); }
template <class T, int N, class A>
inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, const A& a) {
  return x + (y - x) * a;
}

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool signbit(half x) { return (x.bits & 0x8000u) != 0; }
#define JFM_VEC_PRED(NAME)                          \
  template <class T, int N>                         \
  inline vec<bool, N> NAME(const vec<T, N>& v) {    \
    vec<bool, N> r;                                 \
    for (int i = 0; i < N; ++i) r[i] = NAME(v[i]);  \
    return r;                                       \
  }
JFM_VEC_PRED(isnan)
JFM_VEC_PRED(isinf)
JFM_VEC_PRED(isfinite)
#undef JFM_VEC_PRED

template <class T>
inline T select(const T& a, const T& b, bool c) {
  return c ? b : a;
}
template <class T, int N>
inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <int N>
inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (!v[i]) return false;
  return true;
}
template <int N>
inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i)
    if (v[i]) return true;
  return false;
}
template <class T, int N>
inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(a[0] * b[0]);
  for (int i = 1; i < N; ++i) s = T(s + a[i] * b[i]);
  return s;
}

// precise:: names the functions above. fast:: names them too, except that fast math promises
// nothing for an Inf or NaN argument (fast::exp2(-inf) need not be 0): unless the emulator runs
// with JFM_EMULATOR_FAST_MATH=precise, fast::'s transcendental functions return
// JFM_FAST_MATH_GARBAGE for one (a finite value, so a NaN does not look propagated either), and a
// kernel that relies on them fails its tests.
#define JFM_FAST_MATH_GARBAGE 1.0e30f
#define JFM_MATH_NAMES                                                                          \
  using metal::max;                                                                             \
  using metal::min;                                                                             \
  using metal::fmax;                                                                            \
  using metal::fmin;                                                                            \
  using metal::clamp;                                                                           \
  using metal::abs;                                                                             \
  using metal::fabs;                                                                            \
  using metal::floor;                                                                           \
  using metal::ceil;                                                                            \
  using metal::saturate;
#define JFM_TRANSCENDENTAL_NAMES                                                                \
  using metal::exp;                                                                             \
  using metal::exp2;                                                                            \
  using metal::exp10;                                                                           \
  using metal::log;                                                                             \
  using metal::log2;                                                                            \
  using metal::log10;                                                                           \
  using metal::sqrt;                                                                            \
  using metal::rsqrt;                                                                           \
  using metal::sin;                                                                             \
  using metal::cos;                                                                             \
  using metal::tan;                                                                             \
  using metal::tanh;                                                                            \
  using metal::pow;                                                                             \
  using metal::powr;                                                                            \
  using metal::divide;
inline float divide(float x, float y) { return x / y; }
namespace fast {
JFM_MATH_NAMES
inline bool garbage_for(float x) {
  return !__builtin_isfinite(x) && ::jfm::rt::fast_math_garbage();
}
#define JFM_FAST_UNARY(NAME)                                                            \
  JFM_UNARY_COUNTED(NAME, garbage_for(x) ? JFM_FAST_MATH_GARBAGE : metal::NAME(x), (void)0)
JFM_FAST_UNARY(exp)
JFM_FAST_UNARY(exp2)
JFM_FAST_UNARY(exp10)
JFM_FAST_UNARY(log)
JFM_FAST_UNARY(log2)
JFM_FAST_UNARY(log10)
JFM_FAST_UNARY(sqrt)
JFM_FAST_UNARY(rsqrt)
JFM_FAST_UNARY(sin)
JFM_FAST_UNARY(cos)
JFM_FAST_UNARY(tan)
JFM_FAST_UNARY(tanh)
#undef JFM_FAST_UNARY
#undef JFM_UNARY
#undef JFM_UNARY_COUNTED
#define JFM_FAST_BINARY(NAME)                                                      \
  inline float NAME(float x, float y) {                                            \
    return garbage_for(x) || garbage_for(y) ? JFM_FAST_MATH_GARBAGE : metal::NAME(x, y); \
  }
JFM_FAST_BINARY(pow)
JFM_FAST_BINARY(powr)
JFM_FAST_BINARY(divide)
#undef JFM_FAST_BINARY
}  // namespace fast
namespace precise {
JFM_MATH_NAMES
JFM_TRANSCENDENTAL_NAMES
}
#undef JFM_MATH_NAMES
#undef JFM_TRANSCENDENTAL_NAMES

template <class T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr float infinity() { return __builtin_inff(); }
  static constexpr float quiet_NaN() { return __builtin_nanf(""); }
  static constexpr float max() { return 0x1.fffffep127f; }
  static constexpr float min() { return 0x1p-126f; }
  static constexpr float lowest() { return -0x1.fffffep127f; }
  static constexpr float epsilon() { return 0x1p-23f; }
};
template <>
struct numeric_limits<half> {
  static half infinity() { return half::from_bits(0x7c00); }
  static half quiet_NaN() { return half::from_bits(0x7e00); }
  static half max() { return half::from_bits(0x7bff); }
  static half min() { return half::from_bits(0x0400); }
  static half lowest() { return half::from_bits(0xfbff); }
  static half epsilon() { return half::from_bits(0x1400); }
};
#define JFM_INT_LIMITS(T, LO, HI)                          \
  template <>                                              \
  struct numeric_limits<T> {                               \
    static constexpr T max() { return HI; }                \
    static constexpr T min() { return LO; }                \
    static constexpr T lowest() { return LO; }             \
  };
JFM_INT_LIMITS(int, -2147483647 - 1, 2147483647)
JFM_INT_LIMITS(uint, 0u, 4294967295u)
JFM_INT_LIMITS(short, short(-32768), short(32767))
JFM_INT_LIMITS(ushort, ushort(0), ushort(65535))
JFM_INT_LIMITS(long, -9223372036854775807L - 1, 9223372036854775807L)
JFM_INT_LIMITS(ulong, 0ul, 18446744073709551615ul)
#undef JFM_INT_LIMITS

// ---- synchronisation ----------------------------------------------------------------------------
inline void threadgroup_barrier(mem_flags flags, const char* file = __builtin_FILE(),
                                int line = __builtin_LINE()) {
  ::jfm::rt::threadgroup_barrier(unsigned(flags), file, line);
}

namespace detail {
using ::jfm::rt::Slot;
constexpr int W = ::jfm::rt::kSimdWidth;

template <class T>
inline void garbage(T* out) {
  __builtin_memset(static_cast<void*>(out), 0xFF, sizeof(T));  // NaN / -1: undefined value
}

inline const char* resolve_nothing(Slot* const*) { return nullptr; }

// Reductions over the active lanes, in lane order.
template <class T, class Op>
inline const char* reduce(Slot* const* lanes, Op op) {
  bool have = false;
  T acc{};
  for (int i = 0; i < W; ++i) {
    if (!lanes[i]) continue;
    T v = *static_cast<const T*>(lanes[i]->in);
    acc = have ? T(op(acc, v)) : v;
    have = true;
  }
  for (int i = 0; i < W; ++i)
    if (lanes[i]) *static_cast<T*>(lanes[i]->out) = acc;
  return nullptr;
}
template <class T>
const char* resolve_sum(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return a + b; });
}
template <class T>
const char* resolve_product(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return a * b; });
}
template <class T>
const char* resolve_max(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return metal::max(a, b); });
}
template <class T>
const char* resolve_min(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return metal::min(a, b); });
}
template <class T>
const char* resolve_and(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return a & b; });
}
template <class T>
const char* resolve_or(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return a | b; });
}
template <class T>
const char* resolve_xor(Slot* const* l) {
  return reduce<T>(l, [](const T& a, const T& b) { return a ^ b; });
}

// Prefix sums over the active lanes in lane order; arg = 1 for inclusive.
template <class T>
const char* resolve_prefix_sum(Slot* const* lanes) {
  bool have = false;
  T acc{};
  for (int i = 0; i < W; ++i) {
    if (!lanes[i]) continue;
    T v = *static_cast<const T*>(lanes[i]->in);
    T* out = static_cast<T*>(lanes[i]->out);
    if (lanes[i]->arg) {
      acc = have ? T(acc + v) : v;
      *out = acc;
    } else {
      *out = have ? acc : T(0);
      acc = have ? T(acc + v) : v;
    }
    have = true;
  }
  return nullptr;
}

// Shuffles: arg = (mode << 32) | operand; each lane reads one source lane. An out-of-range or
// inactive source gives an all-ones value; shuffle_up/down keep their own value at the edges.
enum ShuffleMode : uint64_t { kAbsolute, kXor, kUp, kDown, kRotateDown, kRotateUp };
template <class T>
const char* resolve_shuffle(Slot* const* lanes) {
  for (int i = 0; i < W; ++i) {
    if (!lanes[i]) continue;
    const uint64_t mode = lanes[i]->arg >> 32;
    const int64_t v = int64_t(uint32_t(lanes[i]->arg));
    int64_t src = i;
    switch (mode) {
      case kAbsolute: src = v; break;
      case kXor: src = i ^ v; break;
      case kUp: src = i - v >= 0 ? i - v : i; break;
      case kDown: src = i + v < W ? i + v : i; break;
      case kRotateDown: src = (i + v) % W; break;
      case kRotateUp: src = ((i - v) % W + W) % W; break;
    }
    T* out = static_cast<T*>(lanes[i]->out);
    if (src >= 0 && src < W && lanes[src]) {
      *out = *static_cast<const T*>(lanes[src]->in);
    } else {
      garbage(out);
    }
  }
  return nullptr;
}

template <class T>
inline T collective(::jfm::rt::ResolveFn fn, const T& x, uint64_t arg, const char* what,
                    const char* file, int line) {
  T out;
  ::jfm::rt::simd_collective(fn, &x, &out, arg, what, file, line);
  return out;
}
}  // namespace detail

#define JFM_SIMD_REDUCE(NAME, RESOLVE)                                                      \
  template <class X, class T = typename JFM_ROOT::jfm::shim::value_of<X>::type>                    \
  inline T NAME(const X& x, const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return detail::collective(&detail::RESOLVE<T>, T(x), 0, #NAME, file, line);             \
  }
JFM_SIMD_REDUCE(simd_sum, resolve_sum)
JFM_SIMD_REDUCE(simd_product, resolve_product)
JFM_SIMD_REDUCE(simd_max, resolve_max)
JFM_SIMD_REDUCE(simd_min, resolve_min)
JFM_SIMD_REDUCE(simd_and, resolve_and)
JFM_SIMD_REDUCE(simd_or, resolve_or)
JFM_SIMD_REDUCE(simd_xor, resolve_xor)
#undef JFM_SIMD_REDUCE

template <class T>
inline T simd_prefix_inclusive_sum(T x, const char* file = __builtin_FILE(),
                                   int line = __builtin_LINE()) {
  return detail::collective(&detail::resolve_prefix_sum<T>, x, 1, "simd_prefix_inclusive_sum",
                            file, line);
}
template <class T>
inline T simd_prefix_exclusive_sum(T x, const char* file = __builtin_FILE(),
                                   int line = __builtin_LINE()) {
  return detail::collective(&detail::resolve_prefix_sum<T>, x, 0, "simd_prefix_exclusive_sum",
                            file, line);
}

#define JFM_SIMD_SHUFFLE(NAME, MODE)                                                          \
  template <class X, class T = typename JFM_ROOT::jfm::shim::value_of<X>::type>                    \
  inline T NAME(const X& x, ushort v, const char* file = __builtin_FILE(),                    \
                int line = __builtin_LINE()) {                                                \
    return detail::collective(&detail::resolve_shuffle<T>, T(x),                              \
                              (uint64_t(detail::MODE) << 32) | v, #NAME, file, line);         \
  }
JFM_SIMD_SHUFFLE(simd_shuffle, kAbsolute)
JFM_SIMD_SHUFFLE(simd_broadcast, kAbsolute)
JFM_SIMD_SHUFFLE(simd_shuffle_xor, kXor)
JFM_SIMD_SHUFFLE(simd_shuffle_up, kUp)
JFM_SIMD_SHUFFLE(simd_shuffle_down, kDown)
JFM_SIMD_SHUFFLE(simd_shuffle_rotate_down, kRotateDown)
JFM_SIMD_SHUFFLE(simd_shuffle_rotate_up, kRotateUp)
#undef JFM_SIMD_SHUFFLE

namespace detail {
template <class T>
const char* resolve_broadcast_first(Slot* const* lanes) {
  int first = 0;
  while (!lanes[first]) ++first;
  for (int i = 0; i < W; ++i)
    if (lanes[i]) *static_cast<T*>(lanes[i]->out) = *static_cast<const T*>(lanes[first]->in);
  return nullptr;
}
}  // namespace detail
template <class T>
inline T simd_broadcast_first(T x, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return detail::collective(&detail::resolve_broadcast_first<T>, x, 0, "simd_broadcast_first",
                            file, line);
}
inline bool simd_all(bool x, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::collective(&detail::resolve_and<bool>, x, 0, "simd_all", file, line);
}
inline bool simd_any(bool x, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return detail::collective(&detail::resolve_or<bool>, x, 0, "simd_any", file, line);
}
inline void simdgroup_barrier(mem_flags flags, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  // The flags travel as the collective's argument (the sanitizer orders memory by them).
  ::jfm::rt::simd_collective(&detail::resolve_nothing, nullptr, nullptr, unsigned(flags),
                             "simdgroup_barrier",
                             file, line);
}

// ---- simdgroup_matrix ---------------------------------------------------------------------------
// Per-lane layout of an 8x8 simdgroup matrix on Apple GPUs: lane L holds row
// (q & 4) + (L / 2) % 4 and columns c, c + 1 with c = (q & 2) * 2 + (L % 2) * 2, where q = L / 4.
// Documented by its use in MLX (mlx/backend/metal/kernels/steel/attn/mma.h, BaseMMAFrag::get_coord)
// and in philipturner/metal-flash-attention, which read and write thread_elements() this way.
inline void simdgroup_coord(uint32_t lane, int* row, int* col) {
  const int q = int(lane / 4);
  *row = (q & 4) + int((lane / 2) % 4);
  *col = (q & 2) * 2 + int(lane % 2) * 2;
}

template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "only 8x8 simdgroup matrices exist");
  vec<T, 2> e;  // this lane's two elements (see simdgroup_coord)
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diagonal) {  // diagonal matrix, as in Metal
    int r, c;
    simdgroup_coord(::jfm::rt::current_lane(), &r, &c);
    e[0] = r == c ? diagonal : T(0);
    e[1] = r == c + 1 ? diagonal : T(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int R, int C>
inline simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, R, C> m;
  m.e = vec<T, 2>(value);
  return m;
}

namespace detail {
struct MatrixAccess {
  const void* ptr;
  ulong elements_per_row;
  ulong origin_x, origin_y;
  bool transpose;
  bool operator!=(const MatrixAccess& o) const {
    return ptr != o.ptr || elements_per_row != o.elements_per_row || origin_x != o.origin_x ||
           origin_y != o.origin_y || transpose != o.transpose;
  }
  // Offset of matrix element (r, c) in memory.
  ulong offset(int r, int c) const {
    return transpose ? (origin_y + ulong(c)) * elements_per_row + origin_x + ulong(r)
                     : (origin_y + ulong(r)) * elements_per_row + origin_x + ulong(c);
  }
};

inline const char* check_uniform(Slot* const* lanes, const char* what) {
  const MatrixAccess* a0 = static_cast<const MatrixAccess*>(lanes[0]->in);
  for (int i = 1; i < W; ++i)
    if (*static_cast<const MatrixAccess*>(lanes[i]->in) != *a0) return what;
  return nullptr;
}

template <class T, class P>
const char* resolve_load(Slot* const* lanes) {
  if (const char* e = check_uniform(lanes, "simdgroup_load arguments differ between lanes"))
    return e;
  for (int i = 0; i < W; ++i) {
    const MatrixAccess& a = *static_cast<const MatrixAccess*>(lanes[i]->in);
    const P* src = static_cast<const P*>(a.ptr);
    vec<T, 2>& out = *static_cast<vec<T, 2>*>(lanes[i]->out);
    int r, c;
    simdgroup_coord(uint32_t(i), &r, &c);
    out[0] = T(src[a.offset(r, c)]);
    out[1] = T(src[a.offset(r, c + 1)]);
  }
  return nullptr;
}

template <class T, class P>
const char* resolve_store(Slot* const* lanes) {
  if (const char* e = check_uniform(lanes, "simdgroup_store arguments differ between lanes"))
    return e;
  for (int i = 0; i < W; ++i) {
    const MatrixAccess& a = *static_cast<const MatrixAccess*>(lanes[i]->in);
    P* dst = static_cast<P*>(const_cast<void*>(a.ptr));
    const vec<T, 2>& v = *static_cast<const vec<T, 2>*>(lanes[i]->out);
    int r, c;
    simdgroup_coord(uint32_t(i), &r, &c);
    dst[a.offset(r, c)] = P(v[0]);
    dst[a.offset(r, c + 1)] = P(v[1]);
  }
  return nullptr;
}

template <class TA, class TB, class TC>
struct MultiplyOperands {
  const vec<TA, 2>* a;
  const vec<TB, 2>* b;
  const vec<TC, 2>* c;  // null: no accumulator
};

// D = A * B (+ C), summed over k in order in float and rounded to D's type once.
template <class TD, class TA, class TB, class TC>
const char* resolve_multiply(Slot* const* lanes) {
  float A[8][8], B[8][8], C[8][8];
  for (int i = 0; i < W; ++i) {
    const MultiplyOperands<TA, TB, TC>& o =
        *static_cast<const MultiplyOperands<TA, TB, TC>*>(lanes[i]->in);
    int r, c;
    simdgroup_coord(uint32_t(i), &r, &c);
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = float((*o.a)[j]);
      B[r][c + j] = float((*o.b)[j]);
      C[r][c + j] = o.c ? float((*o.c)[j]) : 0.0f;
    }
  }
  for (int i = 0; i < W; ++i) {
    vec<TD, 2>& out = *static_cast<vec<TD, 2>*>(lanes[i]->out);
    int r, c;
    simdgroup_coord(uint32_t(i), &r, &c);
    for (int j = 0; j < 2; ++j) {
      float s = 0.0f;
      for (int k = 0; k < 8; ++k) s += A[r][k] * B[k][c + j];
      out[j] = TD(s + C[r][c + j]);
    }
  }
  return nullptr;
}
}  // namespace detail

template <class T, class P>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const P* src, ulong elements_per_row = 8,
                           vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                           bool transpose_matrix = false, const char* file = __builtin_FILE(),
                           int line = __builtin_LINE()) {
  detail::MatrixAccess a{src, elements_per_row, matrix_origin.x, matrix_origin.y,
                         transpose_matrix};
  ::jfm::rt::simd_collective_full(&detail::resolve_load<T, P>, &a, &d.e, 0, "simdgroup_load",
                                  file, line);
}

template <class T, class P>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& s, P* dst,
                            ulong elements_per_row = 8,
                            vec<ulong, 2> matrix_origin = vec<ulong, 2>(0),
                            bool transpose_matrix = false, const char* file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
  detail::MatrixAccess a{dst, elements_per_row, matrix_origin.x, matrix_origin.y,
                         transpose_matrix};
  ::jfm::rt::simd_collective_full(&detail::resolve_store<T, P>, &a,
                                  const_cast<vec<T, 2>*>(&s.e), 0, "simdgroup_store", file, line);
}

template <class TD, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d,
                                          const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b,
                                          const simdgroup_matrix<TC, 8, 8>& c,
                                          const char* file = __builtin_FILE(),
                                          int line = __builtin_LINE()) {
  detail::MultiplyOperands<TA, TB, TC> o{&a.e, &b.e, &c.e};
  ::jfm::rt::simd_collective_full(&detail::resolve_multiply<TD, TA, TB, TC>, &o, &d.e, 0,
                                  "simdgroup_multiply_accumulate", file, line);
}

template <class TD, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b,
                               const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  detail::MultiplyOperands<TA, TB, TD> o{&a.e, &b.e, nullptr};
  ::jfm::rt::simd_collective_full(&detail::resolve_multiply<TD, TA, TB, TD>, &o, &d.e, 0,
                                  "simdgroup_multiply", file, line);
}

// ---- atomics ------------------------------------------------------------------------------------
// Fibers of one threadgroup never interleave inside an operation; threadgroups on different
// workers use real atomics. Only memory_order_relaxed exists in MSL 3.0.
enum memory_order { memory_order_relaxed };

template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;

namespace detail {
template <class T>
struct same {
  typedef T type;
};
template <class T, class F>
inline T atomic_update(volatile atomic<T>* obj, F f) {
  static_assert(sizeof(T) == 4, "32-bit atomics only");
  volatile uint32_t* p = reinterpret_cast<volatile uint32_t*>(&obj->value);
  uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T o = JFM_ROOT::jfm::shim::bitcast<T>(old);
    uint32_t n = JFM_ROOT::jfm::shim::bitcast<uint32_t>(T(f(o)));
    if (__atomic_compare_exchange_n(p, &old, n, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
      return o;
  }
}
}  // namespace detail

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* obj, typename detail::same<T>::type v,
                                  memory_order) {
  detail::atomic_update(obj, [v](T) { return v; });
}
template <class T>
inline T atomic_load_explicit(volatile atomic<T>* obj, memory_order) {
  return detail::atomic_update(obj, [](T o) { return o; });
}
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* obj, typename detail::same<T>::type v,
                                  memory_order) {
  return detail::atomic_update(obj, [v](T) { return v; });
}
#define JFM_ATOMIC_RMW(NAME, EXPR)                                                        \
  template <class T>                                                                      \
  inline T NAME(volatile atomic<T>* obj, typename detail::same<T>::type v, memory_order) { \
    return detail::atomic_update(obj, [v](T o) { return EXPR; });                         \
  }
JFM_ATOMIC_RMW(atomic_fetch_add_explicit, o + v)
JFM_ATOMIC_RMW(atomic_fetch_sub_explicit, o - v)
JFM_ATOMIC_RMW(atomic_fetch_min_explicit, o < v ? o : v)
JFM_ATOMIC_RMW(atomic_fetch_max_explicit, o > v ? o : v)
JFM_ATOMIC_RMW(atomic_fetch_and_explicit, o & v)
JFM_ATOMIC_RMW(atomic_fetch_or_explicit, o | v)
JFM_ATOMIC_RMW(atomic_fetch_xor_explicit, o ^ v)
#undef JFM_ATOMIC_RMW
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* obj, T* expected,
                                                  typename detail::same<T>::type desired,
                                                  memory_order, memory_order) {
  using JFM_ROOT::jfm::shim::bitcast;
  T seen = detail::atomic_update(obj, [&](T o) {
    return bitcast<uint32_t>(o) == bitcast<uint32_t>(*expected) ? desired : o;
  });
  bool ok = bitcast<uint32_t>(seen) == bitcast<uint32_t>(*expected);
  *expected = seen;
  return ok;
}

}  // namespace metal

// Launcher helpers (used by generated code): builtin ids in the declared type.
namespace jfm {
namespace rt {
template <class T>
struct Builtin;
template <>
struct Builtin<uint> {
  static uint get(const uint32_t* v) { return v[0]; }
};
template <>
struct Builtin<ushort> {
  static ushort get(const uint32_t* v) { return ushort(v[0]); }
};
template <class T, int N>
struct Builtin<JFM_ROOT::vec<T, N>> {
  static JFM_ROOT::vec<T, N> get(const uint32_t* v) {
    JFM_ROOT::vec<T, N> r;
    for (int i = 0; i < N; ++i) r[i] = T(v[i]);
    return r;
  }
};
template <class T>
inline T builtin(const uint32_t* v) {
  return Builtin<T>::get(v);
}
template <class T>
inline T builtin(uint32_t v) {
  return T(v);
}
}  // namespace rt
}  // namespace jfm

#endif  // JAX_FLASH_METAL_EMULATOR_METAL_SHIM_H_
