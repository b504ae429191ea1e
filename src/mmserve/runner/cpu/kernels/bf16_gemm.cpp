// mmserve's bfloat16 CPU matmul for the language model's linear layers (runner/cpu/native.py builds
// it, runner/cpu/bf16_gemm.py calls it), on AMX tiles: it runs only where the CPU has them (built
// without, mm_bf16_available() answers 0) and Linux granted the process their use (mm_bf16_amx_init).
//
// y (M, N) bf16 = x (M, K) bf16 @ W^T (+ bias), summed in float32 and rounded once to bfloat16 (round
// to nearest even): the contract of a bfloat16 gemm. W is re-stored once as panels of 16 output
// columns with the inputs in pairs, panels[p][k / 2][j][k % 2] = W[16 p + j][k], zero past N and past
// K, the pairs padded to a multiple of 16: a panel's 16 pairs x 16 columns are one AMX B tile (1 KiB,
// rows of 64 bytes). A block of up to 32 rows x 2 panels keeps 4 float32 accumulator tiles over the
// whole of K; the threads split the pairs of panels, each streamed once per 256 rows (whose inputs
// stay in cache meanwhile). At decode batch sizes the product is bound by reading the weights: half
// the float32 kernel's bytes, and no per-call reordering of them (oneDNN's bfloat16 linear on a plain
// weight reorders it on every call). Every output is the same chain of tile products in k order
// whatever M is, so a row's result does not depend on which rows share its batch. Denormal inputs and
// results are taken as zero (the tiles' arithmetic).
// A CPU with AVX-512 BF16 dot products but no AMX keeps oneDNN's linear: from 8 rows up, those dot
// products (one instruction per cycle, like float32's fused multiply-adds) are slower than it.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#ifdef __AMX_BF16__
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kCols = 16;       // a panel's columns: one 16-float accumulator per row
constexpr int64_t kPairBlock = 16;  // a panel's pairs of k are padded to a multiple of this

inline int64_t padded_pairs(int64_t K) { return ((K + 1) / 2 + kPairBlock - 1) / kPairBlock * kPairBlock; }

#ifdef __AMX_BF16__
struct BFloat16Dot {
  static void sum0() { _tile_dpbf16ps(0, 4, 6); }
  static void sum1() { _tile_dpbf16ps(1, 4, 7); }
  static void sum2() { _tile_dpbf16ps(2, 5, 6); }
  static void sum3() { _tile_dpbf16ps(3, 5, 7); }
};

// rows [m, m + rows_lo + rows_hi) x panels p, p + width - 1 of y; x rows of `ldx` elements, K padded
void amx_block(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t stride, int width, int rows_lo,
               int rows_hi, const float* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  alignas(64) float sums[4 * 16 * kCols];
  amx::block_sums<BFloat16Dot>(reinterpret_cast<const char*>(x), ldx * 2, reinterpret_cast<const char*>(panel),
                               stride * 2 * kCols * 2, stride / kPairBlock, rows_lo, rows_hi, width, sums);
  for (int j = 0; j < width; j++) {
    const int64_t count = j == width - 1 ? cols : kCols;
    const __mmask16 mask = count == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * kCols) : _mm512_setzero_ps();
    for (int r = 0; r < rows_lo + rows_hi; r++) {
      const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums + amx::sums_offset(r, j)), b);
      _mm256_mask_storeu_epi16(y + r * ldy + j * kCols, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

void amx_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* panels, int64_t N,
              const float* bias, uint16_t* y, int64_t ldy, int threads) {
  const int64_t stride = padded_pairs(K), width_k = 2 * stride;
  std::vector<uint16_t> padded;  // x with K padded by zeros, where K is not a whole number of tile steps
  if (K != width_k || ldx < K) {
    padded.assign(M * width_k, 0);
    for (int64_t m = 0; m < M; m++) memcpy(padded.data() + m * width_k, x + m * ldx, K * sizeof(uint16_t));
    x = padded.data();
    ldx = width_k;
  }
  const int64_t count = (N + kCols - 1) / kCols;
  amx::for_each_block(M, count, threads, [&](int64_t m, int rows_lo, int rows_hi, int64_t p, int width) {
    const int64_t last = p + width - 1, cols = N - last * kCols < kCols ? N - last * kCols : kCols;
    amx_block(x + m * ldx, ldx, panels + p * stride * 2 * kCols, stride, width, rows_lo, rows_hi,
              bias ? bias + p * kCols : nullptr, y + m * ldy + p * kCols, ldy, cols);
  });
}
#endif  // __AMX_BF16__

}  // namespace

extern "C" {

int mm_bf16_available() {
#ifdef __AMX_BF16__
  return 1;
#else
  return 0;
#endif
}

// Asks Linux for this process's use of AMX tiles; 1 where the kernel may then use them.
int mm_bf16_amx_init() {
#ifdef __AMX_BF16__
  return amx::request_permission() ? 1 : 0;
#else
  return 0;
#endif
}

// bfloat16 elements of the panels of an (N, K) weight
int64_t mm_bf16_panel_elements(int64_t N, int64_t K) { return (N + kCols - 1) / kCols * padded_pairs(K) * 2 * kCols; }

// w (N, K) bf16 row-major -> panels (mm_bf16_panel_elements(N, K) bf16)
void mm_bf16_pack_panels(const uint16_t* w, uint16_t* panels, int64_t N, int64_t K) {
  const int64_t count = (N + kCols - 1) / kCols, stride = padded_pairs(K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t k2 = 0; k2 < stride; k2++)
      for (int64_t j = 0; j < kCols; j++)
        for (int64_t t = 0; t < 2; t++) {
          const int64_t n = p * kCols + j, k = 2 * k2 + t;
          panels[((p * stride + k2) * kCols + j) * 2 + t] = n < N && k < K ? w[n * K + k] : 0;
        }
}

// panels -> w rows [n0, n1), (n1 - n0, K) bf16 row-major: the dense weight back
void mm_bf16_unpack_panels(const uint16_t* panels, uint16_t* w, int64_t n0, int64_t n1, int64_t K) {
  const int64_t stride = padded_pairs(K);
#pragma omp parallel for schedule(static)
  for (int64_t n = n0; n < n1; n++) {
    const uint16_t* panel = panels + (n / kCols) * stride * 2 * kCols + (n % kCols) * 2;
    for (int64_t k = 0; k < K; k++) w[(n - n0) * K + k] = panel[(k / 2) * 2 * kCols + k % 2];
  }
}

// y (M, N) bf16, row stride ldy = x (M, K) bf16, row stride ldx, @ W^T + bias (float32, may be null);
// only after mm_bf16_available() and mm_bf16_amx_init() both answered 1
void mm_bf16_panel_gemm(const uint16_t* x, int64_t M, int64_t K, int64_t ldx, const uint16_t* panels, int64_t N,
                        const float* bias, uint16_t* y, int64_t ldy, int threads) {
#ifdef __AMX_BF16__
  if (M > 0) amx_gemm(x, M, K, ldx, panels, N, bias, y, ldy, threads);
#endif
}

}  // extern "C"
