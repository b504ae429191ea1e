// mmserve's CPU matmuls on quantized weights (runner/cpu/native.py builds it, runner/cpu/quant_gemm.py
// calls it): y (M, N) = x (M, K) @ W^T (+ bias), W stored in fewer bytes than float32.
//
// The weights are re-stored once as panels of 16 output columns, as panel_gemm.cpp's float32 ones, and
// streamed the same way (a thread's next panel prefetched, a share in each of its tiles), because at
// decode batch sizes the product is bound by reading the weights: fewer bytes a weight is fewer
// milliseconds a step.
// - int8, weight-only: panels[p][k][j] = q[16 p + j][k]; one float scale per output column, applied
//   to the sum after the dot product (sum_k x q) * s.
// - int4, weight-only, group-wise: panels[p][k][j] for j < 8 holds column j in its low nibble and
//   column j + 8 in its high one (values 0..15); per group of `group` k and column a scale s and an
//   offset o = -zero * s, so that w = q * s + o, dequantized in registers before the dot product.
// - w8a8: int8 weights as panels[p][k / 4][j][k % 4] (the groups of 4 padded to a multiple of 16: a
//   panel's 16 groups x 16 columns are one AMX tile), each input row quantized to int8 with a scale
//   of max|x| / 127; the products summed exactly in int32, on AMX tiles where the CPU has them and
//   Linux grants them (mm_q_amx_init), else four a column in int16 pairs then int32 (AVX2's
//   maddubs/madd); y = sum * s_x * s_w, the same bits either way.
// - w4a8: int4's codes, scales and offsets with w8a8's int8 rows: each group's products summed exactly in
//   int32 (VNNI's vpdpbusd where the CPU has it, else AVX2's maddubs/madd), then scaled in float in one
//   fixed order (the same bits either way); the panels keep 8 inputs x 16 columns a 64-byte block.
// A tile with more rows than a few reads its panel from a float copy dequantized once per panel
// (the same floats the registers would hold), so every output is summed in k order in the same
// arithmetic whatever M is: a row's result does not depend on which rows share its batch.
// Built with AVX-512 (runner/cpu/native.py: where the CPU has it), a weight-only tile holds a panel's
// 16 columns in one register and takes up to 12 rows; each output is the same chain of fused
// multiply-adds on the same floats, so the two builds give the same bits. A single row of int8
// weight-only (a decode step at batch 1) goes through eight panels at once, eight of those chains side
// by side (one alone waits on each multiply-add's latency, under the memory's pace): the same bits.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmath>

#ifdef __AMX_INT8__
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t kCols = 16;
#ifdef __AVX512F__
constexpr int kRows = 12;           // weight-only tile: 12 accumulators + weights + broadcast in AVX-512 registers
#else
constexpr int kRows = 6;            // weight-only tile: 12 accumulators + weights + broadcast in AVX2 registers
#endif
constexpr int kW8A8Rows = 4;        // w8a8 tile: 8 int32 accumulators + weights, |a|, products, ones
constexpr int64_t kFusedTiles = 2;  // up to this many tiles a panel dequantizes in registers; above, once
constexpr int64_t kK4Block = 16;    // w8a8 groups of 4 inputs are padded to a multiple of this (one AMX tile)

inline int64_t mm_panels(int64_t N) { return (N + kCols - 1) / kCols; }
inline int64_t mm_k4(int64_t K) { return ((K + 3) / 4 + kK4Block - 1) / kK4Block * kK4Block; }

// A panel's 16 columns at step k, as two 8-float registers, from each storage.
struct FloatPanel {
  const float* w;
  void begin(int64_t) {}
  void load(int64_t k, __m256& lo, __m256& hi) const {
    lo = _mm256_load_ps(w + k * kCols);
    hi = _mm256_load_ps(w + k * kCols + 8);
  }
#ifdef __AVX512F__
  __m512 load16(int64_t k) const { return _mm512_load_ps(w + k * kCols); }
#endif
  int64_t step(int64_t K) const { return K; }
};

struct Int8Panel {
  const int8_t* w;
  void begin(int64_t) {}
  void load(int64_t k, __m256& lo, __m256& hi) const {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kCols));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
  }
#ifdef __AVX512F__
  __m512 load16(int64_t k) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kCols))));
  }
#endif
  int64_t step(int64_t K) const { return K; }
};

struct Int4Panel {
  const uint8_t* w;
  const float* scale;   // [group][16]
  const float* offset;  // [group][16]
  int64_t group;
  __m256 s_lo, s_hi, o_lo, o_hi;
#ifdef __AVX512F__
  __m512 s16, o16;
#endif
  void begin(int64_t k0) {  // the group starting at k0
    const int64_t g = k0 / group;
    s_lo = _mm256_loadu_ps(scale + g * kCols), s_hi = _mm256_loadu_ps(scale + g * kCols + 8);
    o_lo = _mm256_loadu_ps(offset + g * kCols), o_hi = _mm256_loadu_ps(offset + g * kCols + 8);
#ifdef __AVX512F__
    s16 = _mm512_loadu_ps(scale + g * kCols), o16 = _mm512_loadu_ps(offset + g * kCols);
#endif
  }
#ifdef __AVX512F__
  __m512 load16(int64_t k) const {  // columns 0-7 from the low nibbles, 8-15 from the high ones
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 8));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(b, nibble), high = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(low, high))), s16, o16);
  }
#endif
  void load(int64_t k, __m256& lo, __m256& hi) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 8));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(b, nibble), high = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
    lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), s_lo, o_lo);
    hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), s_hi, o_hi);
  }
  int64_t step(int64_t) const { return group; }
};

struct Prefetch {
  const char* next;  // null: nothing to prefetch
  const char* end;
  int64_t every;     // one 64-byte line every `every` steps of k
};

// Prefetch's next line, every `every` steps of k (countdown: steps left until the next).
inline void prefetch_step(Prefetch& pf, int64_t& countdown) {
  if (pf.next && countdown-- == 0) {
    if (pf.next < pf.end) _mm_prefetch(pf.next, _MM_HINT_T0);
    pf.next += 64;
    countdown = pf.every - 1;
  }
}

#ifdef __AVX512F__
template <int R, typename Panel>
void tile(const float* __restrict x, int64_t ldx, Panel panel, int64_t K, const float* __restrict post_scale,
          const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols, Prefetch pf) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
  int64_t countdown = 0;
  const int64_t step = panel.step(K);
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    panel.begin(k0);
    for (int64_t k = k0; k < k0 + step; k++) {
      prefetch_step(pf, countdown);
      const __m512 w = panel.load16(k);
#pragma GCC unroll 16
      for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * ldx + k]), w, acc[i]);
    }
  }
  // the epilogue in explicit fused operations, as the AVX2 tile's (the same bits)
  const __mmask16 mask = cols == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  if (post_scale) {
    const __m512 s = _mm512_maskz_loadu_ps(mask, post_scale);
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_fmadd_ps(acc[i], s, b);
  } else if (bias) {
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) acc[i] = _mm512_add_ps(acc[i], b);
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; i++) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]);
}

// 12-row tiles; a last 13 to 16 rows go as 8 + the rest (a tile of 1 to 4 rows hides little latency)
inline int tile_height(int64_t left) {
  return left > 16 || left == kRows ? kRows : left > kRows ? 8 : static_cast<int>(left);
}
#else
template <int R, typename Panel>
void tile(const float* __restrict x, int64_t ldx, Panel panel, int64_t K, const float* __restrict post_scale,
          const float* __restrict bias, float* __restrict y, int64_t ldy, int64_t cols, Prefetch pf) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t countdown = 0;
  const int64_t step = panel.step(K);
  for (int64_t k0 = 0; k0 < K; k0 += step) {
    panel.begin(k0);
    for (int64_t k = k0; k < k0 + step; k++) {
      prefetch_step(pf, countdown);
      __m256 w_lo, w_hi;
      panel.load(k, w_lo, w_hi);
#pragma GCC unroll 8
      for (int i = 0; i < R; i++) {
        const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
        lo[i] = _mm256_fmadd_ps(a, w_lo, lo[i]);
        hi[i] = _mm256_fmadd_ps(a, w_hi, hi[i]);
      }
    }
  }
  // the epilogue in explicit fused operations: left to the compiler, a multiply and an add may be
  // contracted in one tile height and not in another, and a row's result would depend on its batch
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  if (post_scale) {
    const __m256 s_lo = _mm256_loadu_ps(post_scale), s_hi = _mm256_loadu_ps(post_scale + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) lo[i] = _mm256_fmadd_ps(lo[i], s_lo, b_lo), hi[i] = _mm256_fmadd_ps(hi[i], s_hi, b_hi);
  } else if (bias) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) lo[i] = _mm256_add_ps(lo[i], b_lo), hi[i] = _mm256_add_ps(hi[i], b_hi);
  }
  if (cols == kCols) {
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) _mm256_storeu_ps(y + i * ldy, lo[i]), _mm256_storeu_ps(y + i * ldy + 8, hi[i]);
    return;
  }
  alignas(32) float row[kCols];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) {
    _mm256_store_ps(row, lo[i]);
    _mm256_store_ps(row + 8, hi[i]);
    memcpy(y + i * ldy, row, cols * sizeof(float));
  }
}

// 6-row tiles; a last 7 or 8 rows go as 4 + 3 or 4 + 4
inline int tile_height(int64_t left) {
  return left >= 9 || left == kRows ? kRows : left > kRows ? 4 : static_cast<int>(left);
}
#endif  // __AVX512F__

template <typename Panel>
void tile_rows(int rows, const float* x, int64_t ldx, const Panel& panel, int64_t K, const float* post_scale,
               const float* bias, float* y, int64_t ldy, int64_t cols, Prefetch pf) {
  switch (rows) {
#ifdef __AVX512F__
    case 12: tile<12>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 11: tile<11>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 10: tile<10>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 9: tile<9>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 8: tile<8>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 7: tile<7>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
#endif
    case 6: tile<6>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 5: tile<5>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 4: tile<4>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 3: tile<3>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    case 2: tile<2>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
    default: tile<1>(x, ldx, panel, K, post_scale, bias, y, ldy, cols, pf); break;
  }
}

#ifdef __AVX512F__
// One row times P panels at once. A row's 16 columns are one chain of fused multiply-adds in k order,
// each step waiting on the last one's latency: one panel at a time reads 16 bytes of int8 codes per
// FMA latency, under the memory's pace. P panels are P independent chains, each the chain tile<1>
// computes (the same operations in the same order: the same bits), so the loads and conversions of
// the P panels overlap. The epilogue is tile<1>'s.
constexpr int kRowPanels = 8;

template <int P, typename Panel>
void row_tile_panels(const float* __restrict x, Panel* panel, int64_t K, const float* const* post_scale,
                     const float* const* bias, float* __restrict y, const int64_t* cols) {
  __m512 acc[P];
#pragma GCC unroll 8
  for (int i = 0; i < P; i++) acc[i] = _mm512_setzero_ps();
  const int64_t step = panel[0].step(K);
  for (int64_t k0 = 0; k0 < K; k0 += step) {
#pragma GCC unroll 8
    for (int i = 0; i < P; i++) panel[i].begin(k0);
    for (int64_t k = k0; k < k0 + step; k++) {
      const __m512 a = _mm512_set1_ps(x[k]);
#pragma GCC unroll 8
      for (int i = 0; i < P; i++) acc[i] = _mm512_fmadd_ps(a, panel[i].load16(k), acc[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < P; i++) {
    const __mmask16 mask = cols[i] == kCols ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << cols[i]) - 1);
    const __m512 b = bias[i] ? _mm512_maskz_loadu_ps(mask, bias[i]) : _mm512_setzero_ps();
    __m512 out = acc[i];
    if (post_scale[i]) out = _mm512_fmadd_ps(out, _mm512_maskz_loadu_ps(mask, post_scale[i]), b);
    else if (bias[i]) out = _mm512_add_ps(out, b);
    _mm512_mask_storeu_ps(y + i * kCols, mask, out);
  }
}
#endif

// The 16-wide vectors of the last panel (scales, bias) padded with zeros.
const float* padded(const float* v, int64_t cols, float* buffer) {
  if (!v || cols == kCols) return v;
  memset(buffer, 0, kCols * sizeof(float));
  memcpy(buffer, v, cols * sizeof(float));
  return buffer;
}

// One panel's product over all M rows, with weights of any storage.
template <typename Panel>
void panel_product(const float* x, int64_t M, int64_t K, int64_t ldx, Panel panel, int64_t panel_bytes,
                   const char* next_panel, const float* post_scale, const float* bias, float* y, int64_t ldy,
                   int64_t cols, float* scratch) {
  const int64_t tiles = (M + kRows - 1) / kRows;
  const int64_t lines = (panel_bytes + 63) / 64;
  const int64_t share = (lines + tiles - 1) / tiles;  // lines of the next panel each tile prefetches
  const int64_t every = share ? (K + share - 1) / share : K;
  if (tiles > kFusedTiles) {  // dequantize once into a float panel; the same floats as in registers
    Panel loader = panel;
    const int64_t step = loader.step(K);
    for (int64_t k0 = 0; k0 < K; k0 += step) {
      loader.begin(k0);
      for (int64_t k = k0; k < k0 + step; k++) {
#ifdef __AVX512F__
        _mm512_store_ps(scratch + k * kCols, loader.load16(k));
#else
        __m256 lo, hi;
        loader.load(k, lo, hi);
        _mm256_store_ps(scratch + k * kCols, lo);
        _mm256_store_ps(scratch + k * kCols + 8, hi);
#endif
      }
    }
  }
  int64_t t = 0;
  for (int64_t m = 0; m < M; t++) {
    const int rows = tile_height(M - m);
    Prefetch pf{next_panel ? next_panel + t * share * 64 : nullptr,
                next_panel ? next_panel + (t + 1) * share * 64 : nullptr, every};
    if (pf.end && pf.end > next_panel + lines * 64) pf.end = next_panel + lines * 64;
    if (tiles > kFusedTiles)
      tile_rows(rows, x + m * ldx, ldx, FloatPanel{scratch}, K, post_scale, bias, y + m * ldy, ldy, cols, pf);
    else
      tile_rows(rows, x + m * ldx, ldx, panel, K, post_scale, bias, y + m * ldy, ldy, cols, pf);
    m += rows;
  }
}

float* aligned_floats(int64_t count) {
  const size_t bytes = ((count * sizeof(float) + 63) / 64) * 64;
  return static_cast<float*>(aligned_alloc(64, bytes ? bytes : 64));
}

// ---- w8a8 ------------------------------------------------------------------------------------

// Four inputs of a row times four codes of each of 16 columns, in two 8-column halves: the signed
// products through vpmaddubsw on |a| and w carrying a's sign (at most 2 * 127 * 127 per pair: no
// saturation), summed to int32 per column by vpmaddwd.
template <int R>
void w8a8_tile(const int8_t* __restrict xq, int64_t ldxq, const int8_t* __restrict panel, int64_t K4,
               const float* __restrict w_scale, const float* __restrict x_scale, const float* __restrict bias,
               float* __restrict y, int64_t ldy, int64_t cols, Prefetch pf) {
  __m256i lo[R], hi[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t countdown = 0;
  for (int64_t k4 = 0; k4 < K4; k4++) {
    prefetch_step(pf, countdown);
    const __m256i w_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64));
    const __m256i w_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64 + 32));
#pragma GCC unroll 8
    for (int i = 0; i < R; i++) {
      int32_t quad;
      memcpy(&quad, xq + i * ldxq + 4 * k4, 4);
      const __m256i a = _mm256_set1_epi32(quad), a_abs = _mm256_abs_epi8(a);
      lo[i] = _mm256_add_epi32(lo[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(w_lo, a)), ones));
      hi[i] = _mm256_add_epi32(hi[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a_abs, _mm256_sign_epi8(w_hi, a)), ones));
    }
  }
  const __m256 s_lo = _mm256_loadu_ps(w_scale), s_hi = _mm256_loadu_ps(w_scale + 8);
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  alignas(32) float row[kCols];
#pragma GCC unroll 8
  for (int i = 0; i < R; i++) {
    const __m256 sx = _mm256_set1_ps(x_scale[i]);
    // one fused multiply-add (with a zero bias where there is none): see the weight-only epilogue
    const __m256 v_lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), _mm256_mul_ps(sx, s_lo), b_lo);
    const __m256 v_hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), _mm256_mul_ps(sx, s_hi), b_hi);
    if (cols == kCols) {
      _mm256_storeu_ps(y + i * ldy, v_lo), _mm256_storeu_ps(y + i * ldy + 8, v_hi);
    } else {
      _mm256_store_ps(row, v_lo), _mm256_store_ps(row + 8, v_hi);
      memcpy(y + i * ldy, row, cols * sizeof(float));
    }
  }
}

void w8a8_tile_rows(int rows, const int8_t* xq, int64_t ldxq, const int8_t* panel, int64_t K4, const float* w_scale,
                    const float* x_scale, const float* bias, float* y, int64_t ldy, int64_t cols, Prefetch pf) {
  switch (rows) {
    case 4: w8a8_tile<4>(xq, ldxq, panel, K4, w_scale, x_scale, bias, y, ldy, cols, pf); break;
    case 3: w8a8_tile<3>(xq, ldxq, panel, K4, w_scale, x_scale, bias, y, ldy, cols, pf); break;
    case 2: w8a8_tile<2>(xq, ldxq, panel, K4, w_scale, x_scale, bias, y, ldy, cols, pf); break;
    default: w8a8_tile<1>(xq, ldxq, panel, K4, w_scale, x_scale, bias, y, ldy, cols, pf); break;
  }
}

// ---- w4a8 ------------------------------------------------------------------------------------
// int4 weights (int4's codes, scales and offsets) times rows quantized to int8 as w8a8's: per group, the
// codes' products with the row's int8 inputs summed exactly in int32, then in float, in this order,
// acc = fma(sum, s, acc), acc = fma(o, sum of the group's inputs, acc); finally y = fma(acc, s_x, b).
// Panels hold blocks of 8 inputs x 16 columns in 64 bytes: byte 4 j + t = code(k0 + t, j) |
// code(k0 + 4 + t, j) << 4, so a block's low nibbles are four inputs of every column, one int32 lane a
// column (VNNI's vpdpbusd, or AVX2's maddubs/madd), the high nibbles the next four.

constexpr int kW4A8Rows = 4;

template <int R>
void w4a8_tile(const int8_t* __restrict xq, int64_t ldxq, const float* __restrict xsum, int64_t groups,
               const uint8_t* __restrict panel, int64_t K, int64_t group, const float* __restrict scale,
               const float* __restrict offset, const float* __restrict x_scale, const float* __restrict bias,
               float* __restrict y, int64_t ldy, int64_t cols, Prefetch pf) {
  int64_t countdown = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / group; g++) {
    __m512i lo[R], hi[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm512_setzero_si512();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
      prefetch_step(pf, countdown);
      const __m512i block = _mm512_loadu_si512(panel + k0 * 8);
      const __m512i w0 = _mm512_and_si512(block, nibble), w1 = _mm512_and_si512(_mm512_srli_epi16(block, 4), nibble);
#pragma GCC unroll 4
      for (int i = 0; i < R; i++) {
        int32_t a0, a1;
        memcpy(&a0, xq + i * ldxq + k0, 4);
        memcpy(&a1, xq + i * ldxq + k0 + 4, 4);
        lo[i] = _mm512_dpbusd_epi32(lo[i], w0, _mm512_set1_epi32(a0));
        hi[i] = _mm512_dpbusd_epi32(hi[i], w1, _mm512_set1_epi32(a1));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kCols), o = _mm512_loadu_ps(offset + g * kCols);
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[i], hi[i])), s, acc[i]);
      acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[i * groups + g]), acc[i]);
    }
  }
  const __mmask16 mask = cols == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int i = 0; i < R; i++)
    _mm512_mask_storeu_ps(y + i * ldy, mask, _mm512_fmadd_ps(acc[i], _mm512_set1_ps(x_scale[i]), b));
#else
  __m256 acc_lo[R], acc_hi[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; i++) acc_lo[i] = acc_hi[i] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < K / group; g++) {
    __m256i lo[R], hi[R];  // columns 0-7 and 8-15
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) lo[i] = hi[i] = _mm256_setzero_si256();
    for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 8) {
      prefetch_step(pf, countdown);
      const __m256i b_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k0 * 8));
      const __m256i b_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k0 * 8 + 32));
      const __m256i w0_lo = _mm256_and_si256(b_lo, nibble), w1_lo = _mm256_and_si256(_mm256_srli_epi16(b_lo, 4), nibble);
      const __m256i w0_hi = _mm256_and_si256(b_hi, nibble), w1_hi = _mm256_and_si256(_mm256_srli_epi16(b_hi, 4), nibble);
#pragma GCC unroll 4
      for (int i = 0; i < R; i++) {
        int32_t a0, a1;
        memcpy(&a0, xq + i * ldxq + k0, 4);
        memcpy(&a1, xq + i * ldxq + k0 + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(a0), x1 = _mm256_set1_epi32(a1);
        // codes 0..15 times int8: at most 2 * 15 * 128 a pair, no saturation
        lo[i] = _mm256_add_epi32(lo[i], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w0_lo, x0), ones),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(w1_lo, x1), ones)));
        hi[i] = _mm256_add_epi32(hi[i], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(w0_hi, x0), ones),
                                                         _mm256_madd_epi16(_mm256_maddubs_epi16(w1_hi, x1), ones)));
      }
    }
    const __m256 s_lo = _mm256_loadu_ps(scale + g * kCols), s_hi = _mm256_loadu_ps(scale + g * kCols + 8);
    const __m256 o_lo = _mm256_loadu_ps(offset + g * kCols), o_hi = _mm256_loadu_ps(offset + g * kCols + 8);
#pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
      const __m256 sum_x = _mm256_set1_ps(xsum[i * groups + g]);
      acc_lo[i] = _mm256_fmadd_ps(o_lo, sum_x, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[i]), s_lo, acc_lo[i]));
      acc_hi[i] = _mm256_fmadd_ps(o_hi, sum_x, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[i]), s_hi, acc_hi[i]));
    }
  }
  const __m256 b_lo = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 b_hi = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  alignas(32) float row[kCols];
  for (int i = 0; i < R; i++) {
    const __m256 sx = _mm256_set1_ps(x_scale[i]);
    const __m256 v_lo = _mm256_fmadd_ps(acc_lo[i], sx, b_lo), v_hi = _mm256_fmadd_ps(acc_hi[i], sx, b_hi);
    if (cols == kCols) {
      _mm256_storeu_ps(y + i * ldy, v_lo), _mm256_storeu_ps(y + i * ldy + 8, v_hi);
    } else {
      _mm256_store_ps(row, v_lo), _mm256_store_ps(row + 8, v_hi);
      memcpy(y + i * ldy, row, cols * sizeof(float));
    }
  }
#endif
}

void w4a8_tile_rows(int rows, const int8_t* xq, int64_t ldxq, const float* xsum, int64_t groups, const uint8_t* panel,
                    int64_t K, int64_t group, const float* scale, const float* offset, const float* x_scale,
                    const float* bias, float* y, int64_t ldy, int64_t cols, Prefetch pf) {
  switch (rows) {
    case 4: w4a8_tile<4>(xq, ldxq, xsum, groups, panel, K, group, scale, offset, x_scale, bias, y, ldy, cols, pf); break;
    case 3: w4a8_tile<3>(xq, ldxq, xsum, groups, panel, K, group, scale, offset, x_scale, bias, y, ldy, cols, pf); break;
    case 2: w4a8_tile<2>(xq, ldxq, xsum, groups, panel, K, group, scale, offset, x_scale, bias, y, ldy, cols, pf); break;
    default: w4a8_tile<1>(xq, ldxq, xsum, groups, panel, K, group, scale, offset, x_scale, bias, y, ldy, cols, pf); break;
  }
}

#ifdef __AMX_INT8__
struct Int8Dot {
  static void sum0() { _tile_dpbssd(0, 4, 6); }
  static void sum1() { _tile_dpbssd(1, 4, 7); }
  static void sum2() { _tile_dpbssd(2, 5, 6); }
  static void sum3() { _tile_dpbssd(3, 5, 7); }
};

void w8a8_amx(const int8_t* xq, const float* x_scales, int64_t M, int64_t ldxq, const int8_t* panels, int64_t K4,
              const float* w_scales, int64_t N, const float* bias, float* y, int64_t ldy, int threads) {
  const int64_t count = mm_panels(N), panel_bytes = K4 * 64;
  amx::for_each_block(M, count, threads, [&](int64_t m, int rows_lo, int rows_hi, int64_t p, int width) {
    alignas(64) int32_t sums[4 * 16 * kCols];
    amx::block_sums<Int8Dot>(reinterpret_cast<const char*>(xq + m * ldxq), ldxq,
                             reinterpret_cast<const char*>(panels + p * panel_bytes), panel_bytes, K4 / 16, rows_lo,
                             rows_hi, width, sums);
    for (int j = 0; j < width; j++) {
      const int64_t first = (p + j) * kCols, cols = N - first < kCols ? N - first : kCols;
      const __mmask16 mask = cols == kCols ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
      const __m512 s = _mm512_maskz_loadu_ps(mask, w_scales + first);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + first) : _mm512_setzero_ps();
      for (int r = 0; r < rows_lo + rows_hi; r++) {
        // the AVX2 tile's epilogue, lane for lane
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512(sums + amx::sums_offset(r, j)));
        const __m512 v = _mm512_fmadd_ps(sum, _mm512_mul_ps(_mm512_set1_ps(x_scales[m + r]), s), b);
        _mm512_mask_storeu_ps(y + (m + r) * ldy + first, mask, v);
      }
    }
  });
}
#endif  // __AMX_INT8__

#ifdef __AVX512F__
// int8 weight-only, one row (a decode step at batch 1): kRowPanels panels at a time (row_tile_panels), a
// thread's share of the groups of panels; the last panels of an uneven count one at a time. (int4's
// panels gain nothing this way: their unpacking, not the chain's latency, sets their pace.)
void int8_single_row(const float* x, int64_t K, const int8_t* panels, int64_t N, const float* scales,
                     const float* bias, float* y, int threads) {
  const int64_t count = mm_panels(N);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t first = 0; first < count; first += kRowPanels) {
    const int64_t in_group = count - first < kRowPanels ? count - first : kRowPanels;
    Int8Panel panel[kRowPanels];
    const float* scale[kRowPanels] = {};
    const float* b[kRowPanels] = {};
    int64_t cols[kRowPanels] = {};
    alignas(64) float bias_tail[kCols], scale_tail[kCols];  // only the last panel can be short
    for (int64_t i = 0; i < in_group; i++) {
      const int64_t p = first + i;
      cols[i] = N - p * kCols < kCols ? N - p * kCols : kCols;
      panel[i] = Int8Panel{panels + p * K * kCols};
      b[i] = padded(bias ? bias + p * kCols : nullptr, cols[i], bias_tail);
      scale[i] = padded(scales + p * kCols, cols[i], scale_tail);
    }
    if (in_group == kRowPanels) {
      row_tile_panels<kRowPanels>(x, panel, K, scale, b, y + first * kCols, cols);
    } else {
      for (int64_t i = 0; i < in_group; i++)
        row_tile_panels<1>(x, panel + i, K, scale + i, b + i, y + (first + i) * kCols, cols + i);
    }
  }
}
#endif

}  // namespace

extern "C" {

int64_t mm_q_panels(int64_t N) { return mm_panels(N); }
int64_t mm_q_k4(int64_t K) { return mm_k4(K); }

// Asks Linux for this process's use of AMX tiles; 1 where w8a8 products may then use them.
int mm_q_amx_init() {
#ifdef __AMX_INT8__
  return amx::request_permission() ? 1 : 0;
#else
  return 0;
#endif
}

// q (N, K) int8 row-major -> panels (mm_q_panels(N) * K * 16 bytes).
void mm_q8_pack(const int8_t* q, int8_t* panels, int64_t N, int64_t K) {
  const int64_t count = mm_q_panels(N);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < kCols; j++) {
        const int64_t n = p * kCols + j;
        panels[(p * K + k) * kCols + j] = n < N ? q[n * K + k] : 0;
      }
}

// q (N, K) values 0..15, one per byte -> panels (mm_q_panels(N) * K * 8 bytes).
void mm_q4_pack(const uint8_t* q, uint8_t* panels, int64_t N, int64_t K) {
  const int64_t count = mm_q_panels(N);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t k = 0; k < K; k++)
      for (int64_t j = 0; j < 8; j++) {
        const int64_t n0 = p * kCols + j, n1 = n0 + 8;
        const uint8_t low = n0 < N ? q[n0 * K + k] & 0x0F : 0, high = n1 < N ? q[n1 * K + k] & 0x0F : 0;
        panels[(p * K + k) * 8 + j] = static_cast<uint8_t>(low | (high << 4));
      }
}

// q (N, K) int8 -> w8a8 panels (mm_q_panels(N) * mm_q_k4(K) * 64 bytes), zero past N and K.
void mm_w8a8_pack(const int8_t* q, int8_t* panels, int64_t N, int64_t K) {
  const int64_t count = mm_q_panels(N), K4 = mm_q_k4(K);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t j = 0; j < kCols; j++) {
      const int64_t n = p * kCols + j;
      for (int64_t k = 0; k < K4 * 4; k++)
        panels[((p * K4 + k / 4) * kCols + j) * 4 + k % 4] = n < N && k < K ? q[n * K + k] : 0;
    }
}

// q (N, K) values 0..15, one per byte, K a multiple of 8 -> w4a8 panels (mm_q_panels(N) * K * 8 bytes).
void mm_w4a8_pack(const uint8_t* q, uint8_t* panels, int64_t N, int64_t K) {
  const int64_t count = mm_q_panels(N);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < count; p++)
    for (int64_t k0 = 0; k0 < K; k0 += 8)
      for (int64_t j = 0; j < kCols; j++) {
        const int64_t n = p * kCols + j;
        for (int64_t t = 0; t < 4; t++) {
          const uint8_t low = n < N ? q[n * K + k0 + t] & 0x0F : 0, high = n < N ? q[n * K + k0 + 4 + t] & 0x0F : 0;
          panels[p * K * 8 + k0 * 8 + j * 4 + t] = static_cast<uint8_t>(low | (high << 4));
        }
      }
}

// w4a8 product on quantized rows (mm_quantize_rows, ldxq >= K): scales and offsets [panel][K / group][16]
// floats, as int4's.
void mm_w4a8_gemm(const int8_t* xq, const float* x_scales, int64_t M, int64_t K, int64_t ldxq, const uint8_t* panels,
                  const float* scales, const float* offsets, int64_t group, int64_t N, const float* bias, float* y,
                  int64_t ldy, int threads) {
  if (M <= 0) return;
  const int64_t count = mm_q_panels(N), groups = K / group, panel_bytes = K * 8;
  // each row's inputs summed per group (exact in float: at most 127 * group)
  float* xsum = aligned_floats(M * groups);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      int32_t total = 0;
      for (int64_t k = g * group; k < (g + 1) * group; k++) total += xq[m * ldxq + k];
      xsum[m * groups + g] = static_cast<float>(total);
    }
  const int64_t blocks = K / 8, tiles = (M + kW4A8Rows - 1) / kW4A8Rows;
  const int64_t share = (blocks + tiles - 1) / tiles;  // a block is one 64-byte line
  const int64_t every = share ? (blocks + share - 1) / share : blocks;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < count; p++) {
    const int64_t cols = N - p * kCols < kCols ? N - p * kCols : kCols;
    const uint8_t* panel = panels + p * panel_bytes;
    const char* next = p + 1 < count ? reinterpret_cast<const char*>(panel + panel_bytes) : nullptr;
    alignas(32) float bias_tail[kCols];
    const float* b = padded(bias ? bias + p * kCols : nullptr, cols, bias_tail);
    int64_t t = 0;
    for (int64_t m = 0; m < M; t++) {
      const int rows = M - m >= kW4A8Rows ? kW4A8Rows : static_cast<int>(M - m);
      Prefetch pf{next ? next + t * share * 64 : nullptr, next ? next + (t + 1) * share * 64 : nullptr, every};
      if (pf.end && pf.end > next + panel_bytes) pf.end = next + panel_bytes;
      w4a8_tile_rows(rows, xq + m * ldxq, ldxq, xsum + m * groups, groups, panel, K, group,
                     scales + p * groups * kCols, offsets + p * groups * kCols, x_scales + m, b,
                     y + m * ldy + p * kCols, ldy, cols, pf);
      m += rows;
    }
  }
  free(xsum);
}

// Weight-only product. kind 8: panels int8, scales (N) per column, offsets null, group ignored.
// kind 4: panels int4, scales and offsets [panel][K / group][16] floats.
void mm_q_gemm(int kind, const float* x, int64_t M, int64_t K, int64_t ldx, const void* panels, int64_t N,
               const float* scales, const float* offsets, int64_t group, const float* bias, float* y,
               int64_t ldy, int threads) {
  if (M <= 0) return;
#ifdef __AVX512F__
  if (M == 1 && kind == 8) {
    int8_single_row(x, K, static_cast<const int8_t*>(panels), N, scales, bias, y, threads);
    return;
  }
#endif
  const int64_t count = mm_q_panels(N);
  const bool scratch_needed = (M + kRows - 1) / kRows > kFusedTiles;
  const int64_t panel_bytes = kind == 8 ? K * kCols : K * 8;
  const int64_t groups = kind == 4 ? K / group : 0;
#pragma omp parallel num_threads(threads)
  {
    float* scratch = scratch_needed ? aligned_floats(K * kCols) : nullptr;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; p++) {
      const int64_t cols = N - p * kCols < kCols ? N - p * kCols : kCols;
      const char* base = static_cast<const char*>(panels) + p * panel_bytes;
      const char* next = p + 1 < count ? base + panel_bytes : nullptr;
      alignas(32) float bias_tail[kCols], scale_tail[kCols];
      const float* b = padded(bias ? bias + p * kCols : nullptr, cols, bias_tail);
      float* out = y + p * kCols;
      if (kind == 8) {
        const float* s = padded(scales + p * kCols, cols, scale_tail);
        panel_product(x, M, K, ldx, Int8Panel{reinterpret_cast<const int8_t*>(base)}, panel_bytes, next, s, b,
                      out, ldy, cols, scratch);
      } else {
        Int4Panel panel{reinterpret_cast<const uint8_t*>(base), scales + p * groups * kCols,
                        offsets + p * groups * kCols, group, {}, {}, {}, {}};
        panel_product(x, M, K, ldx, panel, panel_bytes, next, nullptr, b, out, ldy, cols, scratch);
      }
    }
    free(scratch);
  }
}

// Rows of x (M, K) -> int8 codes (M, ldxq), q = round(x / s) with s = max|x| / 127 per row (1 for a
// row of zeros); the codes past K are 0.
void mm_quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* xq, int64_t ldxq, float* scales,
                      int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M > 16)
  for (int64_t m = 0; m < M; m++) {
    const float* row = x + m * ldx;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    scales[m] = s;
    int8_t* out = xq + m * ldxq;
    for (int64_t k = 0; k < K; k++) {
      float q = nearbyintf(row[k] / s);
      q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
      out[k] = static_cast<int8_t>(q);
    }
    for (int64_t k = K; k < ldxq; k++) out[k] = 0;
  }
}

// w8a8 product on quantized rows (mm_quantize_rows, ldxq = mm_q_k4(K) * 4); on AMX tiles where `amx`
// (granted by mm_q_amx_init)
void mm_w8a8_gemm(const int8_t* xq, const float* x_scales, int64_t M, int64_t K, int64_t ldxq, const int8_t* panels,
                  const float* w_scales, int64_t N, const float* bias, float* y, int64_t ldy, int threads, int amx) {
  if (M <= 0) return;
  const int64_t count = mm_q_panels(N), K4 = mm_q_k4(K), panel_bytes = K4 * 64;
#ifdef __AMX_INT8__
  if (amx) {
    w8a8_amx(xq, x_scales, M, ldxq, panels, K4, w_scales, N, bias, y, ldy, threads);
    return;
  }
#else
  (void)amx;
#endif
  const int64_t tiles = (M + kW8A8Rows - 1) / kW8A8Rows;
  const int64_t share = (K4 + tiles - 1) / tiles;  // a panel step is one 64-byte line
  const int64_t every = share ? (K4 + share - 1) / share : K4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < count; p++) {
    const int64_t cols = N - p * kCols < kCols ? N - p * kCols : kCols;
    const int8_t* panel = panels + p * panel_bytes;
    const char* next = p + 1 < count ? reinterpret_cast<const char*>(panel + panel_bytes) : nullptr;
    alignas(32) float bias_tail[kCols], scale_tail[kCols];
    const float* b = padded(bias ? bias + p * kCols : nullptr, cols, bias_tail);
    const float* s = padded(w_scales + p * kCols, cols, scale_tail);
    int64_t t = 0;
    for (int64_t m = 0; m < M; t++) {
      const int rows = M - m >= kW8A8Rows ? kW8A8Rows : static_cast<int>(M - m);
      Prefetch pf{next ? next + t * share * 64 : nullptr, next ? next + (t + 1) * share * 64 : nullptr, every};
      if (pf.end && pf.end > next + K4 * 64) pf.end = next + K4 * 64;
      w8a8_tile_rows(rows, xq + m * ldxq, ldxq, panel, K4, s, x_scales + m, b, y + m * ldy + p * kCols, ldy, cols,
                     pf);
      m += rows;
    }
  }
}

}  // extern "C"
