// AMX tile plumbing shared by mmserve's kernels that multiply on tiles (bf16_gemm.cpp, quant_gemm.cpp's
// w8a8): the process's permission, the tile shapes, and the loop over blocks of rows and pairs of
// panels. A kernel includes it only when built with AMX (runner/cpu/native.py adds the flags where the
// CPU has AMX; its build key covers this header).
//
// Tiles, for a block of up to 32 rows x 2 panels of 16 output columns: 0-3 the sums of rows 0-15 /
// 16-31 x panel 0 / 1 (16 x 16 32-bit), 4 and 5 those rows' inputs, 6 and 7 the two panels' weights
// (16 rows of 64 bytes each: what one tile product consumes of K).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

constexpr int64_t kBlockRows = 32;  // rows a block multiplies: two input tiles of 16
constexpr int64_t kRowChunk = 256;  // rows whose inputs stay in cache while every panel streams past once

// Asks Linux for this process's use of AMX tiles; true where it was granted.
inline bool request_permission() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A tile left empty (rows_hi = 0: tiles 2, 3 and 5) must not be touched until configured again.
inline void configure(int rows_lo, int rows_hi) {
  TileConfig cfg;
  const int rows[8] = {rows_lo, rows_lo, rows_hi, rows_hi, rows_lo, rows_hi, 16, 16};
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// block(m, rows_lo, rows_hi, p, width) for every block of rows [m, m + rows_lo + rows_hi) and every pair
// of panels (p, and p + 1 where width is 2) of `panels` panels, the threads splitting the pairs; each
// thread configures its tiles as the block shapes change and releases them at the end.
template <typename Block>
void for_each_block(int64_t M, int64_t panels, int threads, const Block& block) {
  const int64_t pairs = (panels + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
    int configured_lo = -1, configured_hi = -1;
    for (int64_t chunk = 0; chunk < M; chunk += kRowChunk) {
      const int64_t chunk_end = chunk + kRowChunk < M ? chunk + kRowChunk : M;
#pragma omp for schedule(static)
      for (int64_t q = 0; q < pairs; q++) {
        const int64_t p = 2 * q;
        const int width = p + 1 < panels ? 2 : 1;
        for (int64_t m = chunk; m < chunk_end; m += kBlockRows) {
          const int64_t left = chunk_end - m;
          const int rows_lo = left >= 16 ? 16 : static_cast<int>(left);
          const int rows_hi = left >= 32 ? 16 : left > 16 ? static_cast<int>(left - 16) : 0;
          if (rows_lo != configured_lo || rows_hi != configured_hi) {
            configure(rows_lo, rows_hi);
            configured_lo = rows_lo, configured_hi = rows_hi;
          }
          block(m, rows_lo, rows_hi, p, width);
        }
      }
    }
    if (configured_lo >= 0) _tile_release();
  }
}

// The 32-bit sums of one block (rows_lo + rows_hi rows x width panels) over `steps` tile products, into
// sums[tile][row][column] (tiles as above). Each product takes 64 bytes of every input row (at
// x + step * 64, rows x_stride_bytes apart) and a panel's next 1 KiB; Dot's four calls are the product
// instruction (bfloat16 or int8) on the four (sum, input, weight) tile triples, spelled with literal
// tile numbers (the intrinsics paste them into assembly). Every row's sums depend on its inputs alone.
template <typename Dot>
void block_sums(const char* x, int64_t x_stride_bytes, const char* panel, int64_t panel_bytes, int64_t steps,
                int rows_lo, int rows_hi, int width, void* sums) {
  (void)rows_lo;
  _tile_zero(0);
  _tile_zero(1);
  if (rows_hi) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const char* other = panel + panel_bytes;
  const char* x_hi = x + 16 * x_stride_bytes;
  for (int64_t s = 0; s < steps; s++) {
    _tile_loadd(4, x + s * 64, x_stride_bytes);
    _tile_loadd(6, panel + s * 1024, 64);
    Dot::sum0();
    if (width == 2) {
      _tile_loadd(7, other + s * 1024, 64);
      Dot::sum1();
    }
    if (rows_hi) {
      _tile_loadd(5, x_hi + s * 64, x_stride_bytes);
      Dot::sum2();
      if (width == 2) Dot::sum3();
    }
  }
  char* out = static_cast<char*>(sums);
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 1024, 64);
  if (rows_hi) {
    _tile_stored(2, out + 2048, 64);
    _tile_stored(3, out + 3072, 64);
  }
}

// where row r of a block, panel j of its pair, lies in block_sums' output
inline int64_t sums_offset(int r, int j) { return ((r >= 16) * 2 + j) * 256 + (r % 16) * 16; }

}  // namespace amx
