// mmserve's float32 CPU attention over the paged KV cache (runner/cpu/native.py builds it,
// runner/cpu/attention.py calls it), one query row at a time: a step's decodes, and the tokens of its
// prefill chunks, each a query at its own position. Each query attends over its sequence's keys where
// they lie, block by block through its block table: nothing is gathered into a padded copy first,
// which cost more than the attention itself at decode batch sizes.
//
// out[i, h] = softmax(scale * q[i, h] . K_i^T) V_i over the keys j of sequence i that its query at
// position pos[i] sees: j <= pos[i] and, with a window w > 0, j > pos[i] - w. Key j of sequence i is
// row j % block_size of block table[i][j / block_size] of the layer's (blocks, block_size, kv_heads,
// head_dim) cache. The query heads that share a kv head are done together, so each key and value row
// is read once per kv head (a group of up to 8 heads; more heads take more groups). Each (sequence, kv head) is computed on its own, in the same order
// whatever the batch, so a sequence's result does not depend on which sequences share its step.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include <vector>

namespace {

// exp on 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), about 1 ulp; the
// softmax's arguments are <= 0, and ones below -87.3 give 0 (expf would give subnormals down to
// -103.9: nothing a sum of at least 1 can see)
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
  return _mm256_andnot_ps(is_tiny, y);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// scores[g * keys + j] = scale * q_g . k_j for the G heads of one kv head; D a multiple of 8
template <int G>
void scores_of(const float* q, int64_t D, const float* const* key_rows, int64_t keys, float* scores, float scale) {
  for (int64_t j = 0; j < keys; j++) {
    const float* k = key_rows[j];
    if (j + 8 < keys)  // the row 8 keys ahead, each of its cache lines (rows lie a block table apart)
      for (int64_t d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(key_rows[j + 8] + d), _MM_HINT_T0);
    __m256 acc[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
#pragma GCC unroll 8
      for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; g++) scores[g * keys + j] = hsum8(acc[g]) * scale;
  }
}

void scores_any(int64_t G, const float* q, int64_t D, const float* const* key_rows, int64_t keys, float* scores,
                float scale) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) scores_of<8>(q + g * D, D, key_rows, keys, scores + g * keys, scale);
  for (; g + 4 <= G; g += 4) scores_of<4>(q + g * D, D, key_rows, keys, scores + g * keys, scale);
  for (; g + 2 <= G; g += 2) scores_of<2>(q + g * D, D, key_rows, keys, scores + g * keys, scale);
  for (; g < G; g++) scores_of<1>(q + g * D, D, key_rows, keys, scores + g * keys, scale);
}

// p = exp(s - max s) in place over one head's scores; returns the sum of p
float softmax_numerators(float* s, int64_t keys) {
  float top = -INFINITY;
  for (int64_t j = 0; j < keys; j++) top = s[j] > top ? s[j] : top;
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), top8));
    _mm256_storeu_ps(s + j, p);
    sum8 = _mm256_add_ps(sum8, p);
  }
  float sum = hsum8(sum8);
  if (j < keys) {  // the tail, through the same vector exp
    alignas(32) float tail[8];
    for (int t = 0; t < 8; t++) tail[t] = j + t < keys ? s[j + t] - top : -INFINITY;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t t = 0; j + t < keys; t++) s[j + t] = tail[t], sum += tail[t];
  }
  return sum;
}

// out[g][d] = sum_j p[g][j] v_j[d] * inv[g] for the G heads of one kv head (p: G rows of `keys`, out: G
// rows of D; D a multiple of 8). Each value row is read once for all G heads: C vectors of it at a time,
// G * C accumulators in registers. Each output element sums over j in order, whatever G and C.
template <int G, int C>
void weighted_values_of(const float* p, int64_t keys, const float* inv, int64_t D, const float* const* value_rows,
                        float* out) {
  for (int64_t d0 = 0; d0 < D; d0 += 8 * C) {
    const int64_t chunks = (D - d0) / 8 < C ? (D - d0) / 8 : C;
    __m256 acc[G][C];
#pragma GCC unroll 8
    for (int g = 0; g < G; g++)
#pragma GCC unroll 8
      for (int c = 0; c < C; c++) acc[g][c] = _mm256_setzero_ps();
    if (chunks == C) {
      for (int64_t j = 0; j < keys; j++) {
        const float* v = value_rows[j] + d0;
        if (j + 8 < keys)  // the chunk of the row 8 keys ahead, each of its cache lines
          for (int c = 0; c < C; c += 2) _mm_prefetch(reinterpret_cast<const char*>(value_rows[j + 8] + d0 + 8 * c),
                                                      _MM_HINT_T0);
        __m256 row[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; c++) row[c] = _mm256_loadu_ps(v + 8 * c);
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
          const __m256 pj = _mm256_set1_ps(p[g * keys + j]);
#pragma GCC unroll 8
          for (int c = 0; c < C; c++) acc[g][c] = _mm256_fmadd_ps(pj, row[c], acc[g][c]);
        }
      }
    } else {  // the head's last, narrower chunk
      for (int64_t j = 0; j < keys; j++) {
        const float* v = value_rows[j] + d0;
        for (int g = 0; g < G; g++) {
          const __m256 pj = _mm256_set1_ps(p[g * keys + j]);
          for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; g++)
      for (int64_t c = 0; c < chunks; c++)
        _mm256_storeu_ps(out + g * D + d0 + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
  }
}

// the G heads' weighted values, in groups of 8, 4, 2 and 1 heads (8 to 12 accumulators each)
void weighted_values_any(int64_t G, const float* p, int64_t keys, const float* inv, int64_t D,
                         const float* const* value_rows, float* out) {
  int64_t g = 0;
  for (; g + 8 <= G; g += 8) weighted_values_of<8, 1>(p + g * keys, keys, inv + g, D, value_rows, out + g * D);
  for (; g + 4 <= G; g += 4) weighted_values_of<4, 2>(p + g * keys, keys, inv + g, D, value_rows, out + g * D);
  for (; g + 2 <= G; g += 2) weighted_values_of<2, 4>(p + g * keys, keys, inv + g, D, value_rows, out + g * D);
  for (; g < G; g++) weighted_values_of<1, 8>(p + g * keys, keys, inv + g, D, value_rows, out + g * D);
}

}  // namespace

extern "C" {

// q (n, heads, D) contiguous; key/value: one layer's cache (num_blocks, block_size, kv_heads, D) contiguous;
// table (sequences, width) block ids; seq (n,) the table row of each query, or null: query i uses row i;
// pos (n,) each query's position; window <= 0: none; out (n, heads * D).
// D must be a multiple of 8, positions >= 0 and within the table's blocks (runner/cpu/attention.py checks
// the shapes and dtypes; the positions are the engine's own).
void mm_paged_attention(const float* q, int64_t n, int64_t heads, int64_t kv_heads, int64_t D,
                               const float* key, const float* value, int64_t block_size, const int64_t* table,
                               int64_t width, const int64_t* seq, const int64_t* pos, float scale, int64_t window,
                               float* out, int threads) {
  const int64_t group = heads / kv_heads;
  const int64_t row_stride = kv_heads * D, block_stride = block_size * row_stride;
#pragma omp parallel num_threads(threads)
  {
    std::vector<const float*> key_rows, value_rows;
    std::vector<float> scores, inv(group);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * kv_heads; task++) {
      const int64_t i = task / kv_heads, h = task % kv_heads;
      const int64_t* blocks = table + (seq ? seq[i] : i) * width;
      const int64_t first = window > 0 && pos[i] - window + 1 > 0 ? pos[i] - window + 1 : 0;
      const int64_t keys = pos[i] + 1 - first;
      key_rows.resize(keys);
      value_rows.resize(keys);
      scores.resize(group * keys);
      for (int64_t j = 0; j < keys; j++) {
        const int64_t t = first + j;
        const int64_t offset = blocks[t / block_size] * block_stride + (t % block_size) * row_stride + h * D;
        key_rows[j] = key + offset;
        value_rows[j] = value + offset;
      }
      const float* qh = q + (i * heads + h * group) * D;
      scores_any(group, qh, D, key_rows.data(), keys, scores.data(), scale);
      for (int64_t g = 0; g < group; g++) inv[g] = 1.0f / softmax_numerators(scores.data() + g * keys, keys);
      weighted_values_any(group, scores.data(), keys, inv.data(), D, value_rows.data(), out + (i * heads + h * group) * D);
    }
  }
}

}  // extern "C"
