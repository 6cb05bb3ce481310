// Host conversions between float and the 16-bit and 8-bit float formats of the pages.
// Round-to-nearest-even, matching CUDA's __float2half_rn and __nv_cvt_float_to_fp8(...,
// __NV_SATFINITE, __NV_E4M3), so that the CPU reference and the kernels agree bit for bit.
#ifndef KVPOOL_KERNELS_FP16_H_
#define KVPOOL_KERNELS_FP16_H_

#include <cstddef>
#include <cstdint>

namespace kvpool {

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);  // RNE; overflow to +-inf; NaN stays NaN
// FloatToHalf over an array, bit for bit; uses the CPU's F16C conversion where it has one.
void FloatsToHalves(const float* in, uint16_t* out, size_t n);
// HalfToFloat over an array, bit for bit; uses the CPU's F16C conversion where it has one.
void HalvesToFloats(const uint16_t* in, float* out, size_t n);

// e4m3 (bias 7, max 448, no infinities, S.1111.111 = NaN).
float Fp8E4M3ToFloat(uint8_t v);
uint8_t FloatToFp8E4M3(float f);  // RNE, saturating to +-448; NaN -> 0x7F

}  // namespace kvpool

#endif  // KVPOOL_KERNELS_FP16_H_
