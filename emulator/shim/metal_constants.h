// Metal standard library constants, shared by the runtime shim and the strict-pass shim.
#ifndef JFM_EMU_METAL_CONSTANTS_H_
#define JFM_EMU_METAL_CONSTANTS_H_

#define MAXFLOAT 3.402823466e+38f
#define HUGE_VALF __builtin_huge_valf()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX 3.402823466e+38f
#define FLT_MIN 1.175494351e-38f
#define FLT_EPSILON 1.192092896e-07f
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_SQRT2_F 1.41421356237309504880f

#endif  // JFM_EMU_METAL_CONSTANTS_H_
