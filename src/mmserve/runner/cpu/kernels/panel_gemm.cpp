// mmserve's float32 CPU matmul for the language model's linear layers (runner/cpu/native.py builds it,
// runner/cpu/gemm.py calls it).
//
// y (M, N) = x (M, K) @ W^T (+ bias), with W re-stored once as panels of 16 output columns:
// panels[p][k][j] = W[16 p + j][k], zero past N. One 6-row x 16-column tile keeps its 12 accumulators
// in AVX2 registers over the whole of K; the threads split the panels. While a thread works on a
// panel it prefetches its next one, a share in each of the panel's tiles, so at decode batch sizes
// (where each weight is used by a few rows only) the weights stream in from memory behind the
// arithmetic instead of before it. Spread over all the tiles rather than issued in the first one:
// a whole 40 KB panel requested within one tile asks more of one core's outstanding misses than it
// has, and stalls that tile.
// Every output is one dot product summed in k order whatever M is, so a row's result does not
// depend on which rows share its batch.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int64_t kCols = 16;  // a panel's columns: two 8-float registers
constexpr int kRows = 6;       // a tile's rows: 12 accumulators + 2 weight + 1 broadcast registers

template <int R>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
          const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols,
          const float* prefetch, int64_t every) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t countdown = 0;  // prefetch one 64-byte panel row (16 floats) every `every` steps of k
  for (int64_t k = 0; k < K; k++) {
    if (prefetch && countdown-- == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T0);
      prefetch += kCols;
      countdown = every - 1;
    }
    const __m256 w_lo = _mm256_load_ps(panel + k * kCols), w_hi = _mm256_load_ps(panel + k * kCols + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
      lo[i] = _mm256_fmadd_ps(a, w_lo, lo[i]);
      hi[i] = _mm256_fmadd_ps(a, w_hi, hi[i]);
    }
  }
  if (bias) {  // added after the product, as a gemm with beta = 1 does
    const __m256 b_lo = _mm256_loadu_ps(bias), b_hi = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) lo[i] = _mm256_add_ps(lo[i], b_lo), hi[i] = _mm256_add_ps(hi[i], b_hi);
  }
  if (cols == kCols) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) _mm256_storeu_ps(y + i * ldy, lo[i]), _mm256_storeu_ps(y + i * ldy + 8, hi[i]);
    return;
  }
  alignas(32) float row[kCols];  // the last panel: only its columns below N are written
  // (every loop over the tile's rows is unrolled: an indexed one would keep the accumulators in memory)
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) {
    _mm256_store_ps(row, lo[i]);
    _mm256_store_ps(row + 8, hi[i]);
    memcpy(y + i * ldy, row, cols * sizeof(float));
  }
}

void tile_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
               int64_t ldy, int64_t cols, const float* prefetch, int64_t every) {
  switch (rows) {
    case 6: tile<6>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 5: tile<5>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 4: tile<4>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 3: tile<3>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 2: tile<2>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    default: tile<1>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
  }
}

}  // namespace

extern "C" {

int64_t mm_panel_floats(int64_t N, int64_t K) { return (N + kCols - 1) / kCols * K * kCols; }

// w (N, K) row-major -> panels (mm_panel_floats(N, K) floats, 32-byte aligned).
void mm_pack_panels(const float* w, float* panels, int64_t N, int64_t K) {
  const int64_t count = (N + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < kCols; j++) {
        const int64_t n = p * kCols + j;
        panels[(p * K + k) * kCols + j] = n < N ? w[n * K + k] : 0.0f;
      }
}

// y (M, N), row stride ldy = x (M, K), row stride ldx, @ W^T + bias (bias may be null).
void mm_panel_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const float* panels, int64_t N,
                   const float* bias, float* y, int64_t ldy, int threads) {
  if (M <= 0) return;
  const int64_t count = (N + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < count; p++) {
    const float* panel = panels + p * K * kCols;
    const float* next = p + 1 < count ? panel + K * kCols : nullptr;  // this thread's next panel (static split)
    const int64_t cols = N - p * kCols < kCols ? N - p * kCols : kCols;
    const float* b = bias ? bias + p * kCols : nullptr;
    float* b_tail = nullptr;
    alignas(32) float padded_bias[kCols];
    if (b && cols < kCols) {  // the bias is read 16 wide: pad the last panel's
      memset(padded_bias, 0, sizeof(padded_bias));
      memcpy(padded_bias, b, cols * sizeof(float));
      b_tail = padded_bias;
    }
    // tile t prefetches rows [t * share, (t + 1) * share) of the next panel, one every `tiles` k
    const int64_t tiles = (M + kRows - 1) / kRows;
    const int64_t share = (K + tiles - 1) / tiles;
    int64_t tile_index = 0;
    for (int64_t m = 0; m < M;) {
      const int64_t left = M - m;
      // 6-row tiles; a last 7 or 8 rows go as 4 + 3 or 4 + 4, since a 1- or 2-row tile has too few
      // independent accumulators to hide the FMA latency
      const int rows = left >= 9 || left == 6 ? kRows : left > kRows ? 4 : static_cast<int>(left);
      tile_rows(rows, x + m * ldx, ldx, panel, K, b_tail ? b_tail : b, y + m * ldy + p * kCols, ldy, cols,
                next && tile_index * share < K ? next + tile_index * share * kCols : nullptr, tiles);
      m += rows;
      tile_index++;
    }
  }
}

}  // extern "C"
