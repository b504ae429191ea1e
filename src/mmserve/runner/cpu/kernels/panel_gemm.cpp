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
// Built with AVX-512 (runner/cpu/native.py: where the CPU has it), a panel is one 16-float register
// and a tile takes up to 12 rows: twice the arithmetic per instruction. Each output is the same
// chain of fused multiply-adds in k order, so the two builds give the same bits.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int64_t kCols = 16;  // a panel's columns: two 8-float registers (AVX2) or one 16-float one
#ifdef __AVX512F__
constexpr int kRows = 12;      // a tile's rows: 12 accumulators + 1 weight register, broadcasts from memory
#else
constexpr int kRows = 6;       // a tile's rows: 12 accumulators + 2 weight + 1 broadcast registers
#endif

#ifdef __AVX512F__
// R rows x P panels (P = 1 or 2, adjacent in memory): each broadcast of x feeds P accumulators
template <int R, int P>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
          const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols,
          const float* prefetch, int64_t every) {
  __m512 acc[R][P];
#pragma GCC unroll 16
  for (int i = 0; i < R; i++)
#pragma GCC unroll 2
    for (int j = 0; j < P; j++) acc[i][j] = _mm512_setzero_ps();
  int64_t countdown = 0;  // prefetch P 64-byte panel rows every `every` steps of k
  for (int64_t k = 0; k < K; k++) {
    if (prefetch && countdown-- == 0) {
#pragma GCC unroll 2
      for (int j = 0; j < P; j++) _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * kCols), _MM_HINT_T0);
      prefetch += P * kCols;
      countdown = every - 1;
    }
    __m512 w[P];
#pragma GCC unroll 2
    for (int j = 0; j < P; j++) w[j] = _mm512_loadu_ps(panel + (j * K + k) * kCols);
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 2
      for (int j = 0; j < P; j++) acc[i][j] = _mm512_fmadd_ps(a, w[j], acc[i][j]);
    }
  }
  // `cols`: the columns of the tile's last panel below N
#pragma GCC unroll 2
  for (int j = 0; j < P; j++) {
    const int64_t width = j == P - 1 ? cols : kCols;
    const __mmask16 mask = width == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << width) - 1);
    if (bias) {  // added after the product, as a gemm with beta = 1 does
      const __m512 b = _mm512_maskz_loadu_ps(mask, bias + j * kCols);
#pragma GCC unroll 16
      for (int i = 0; i < R; i++) acc[i][j] = _mm512_add_ps(acc[i][j], b);
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * ldy + j * kCols, mask, acc[i][j]);
  }
}

// 12-row tiles; a last 13 to 16 rows go as 8 + the rest, since a tile of 1 to 4 rows has too few
// independent accumulators to hide the FMA latency
inline int tile_height(int64_t left) {
  return left > 16 || left == kRows ? kRows : left > kRows ? 8 : static_cast<int>(left);
}

template <int P>
void tile_rows(int rows, const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
               int64_t ldy, int64_t cols, const float* prefetch, int64_t every) {
  switch (rows) {
    case 12: tile<12, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 11: tile<11, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 10: tile<10, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 9: tile<9, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 8: tile<8, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 7: tile<7, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 6: tile<6, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 5: tile<5, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 4: tile<4, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 3: tile<3, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    case 2: tile<2, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
    default: tile<1, P>(x, ldx, panel, K, bias, y, ldy, cols, prefetch, every); break;
  }
}

// the threads split pairs of panels; each tile covers both panels of its pair
void panel_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const float* panels, int64_t N,
                const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t count = (N + kCols - 1) / kCols, pairs = (count + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t q = 0; q < pairs; q++) {
    const int64_t p = 2 * q;
    const int width = p + 1 < count ? 2 : 1;
    const float* panel = panels + p * K * kCols;
    const float* next = q + 1 < pairs ? panel + 2 * K * kCols : nullptr;  // this thread's next pair
    const int64_t last = p + width - 1, cols = N - last * kCols < kCols ? N - last * kCols : kCols;
    const float* b = bias ? bias + p * kCols : nullptr;
    // tile t prefetches lines [t * share, (t + 1) * share) of the next pair, `width` every `tiles` k
    const int64_t tiles = (M + kRows - 1) / kRows;
    const int64_t share = (2 * K + tiles - 1) / tiles;
    int64_t tile_index = 0;
    for (int64_t m = 0; m < M;) {
      const int rows = tile_height(M - m);
      const float* fetch = next && tile_index * share < 2 * K ? next + tile_index * share * kCols : nullptr;
      if (width == 2) tile_rows<2>(rows, x + m * ldx, ldx, panel, K, b, y + m * ldy + p * kCols, ldy, cols, fetch, tiles);
      else tile_rows<1>(rows, x + m * ldx, ldx, panel, K, b, y + m * ldy + p * kCols, ldy, cols, fetch, tiles);
      m += rows;
      tile_index++;
    }
  }
}
#else

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

// 6-row tiles; a last 7 or 8 rows go as 4 + 3 or 4 + 4, since a 1- or 2-row tile has too few
// independent accumulators to hide the FMA latency
inline int tile_height(int64_t left) {
  return left >= 9 || left == kRows ? kRows : left > kRows ? 4 : static_cast<int>(left);
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

// the threads split the panels
void panel_gemm(const float* x, int64_t M, int64_t K, int64_t ldx, const float* panels, int64_t N,
                const float* bias, float* y, int64_t ldy, int threads) {
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
      const int rows = tile_height(M - m);
      tile_rows(rows, x + m * ldx, ldx, panel, K, b_tail ? b_tail : b, y + m * ldy + p * kCols, ldy, cols,
                next && tile_index * share < K ? next + tile_index * share * kCols : nullptr, tiles);
      m += rows;
      tile_index++;
    }
  }
}
#endif  // __AVX512F__

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
  panel_gemm(x, M, K, ldx, panels, N, bias, y, ldy, threads);
}

}  // extern "C"
