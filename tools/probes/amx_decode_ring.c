/* The AMX one-token MXFP4 product's two shapes (see README.md), one thread: 48 rows (three
 * weight tiles) of a 3584-column MXFP4 matrix against one activation tile, per 32-column
 * group decoded into bf16 (`vpmovzxbd`, `vpslld`, `vpord`, one `vpermw` in the scale's row
 * of a 256 x 32 table), then three `TDPBF16PS`:
 *   - "strip per block": a block of 64 groups of the 48 rows decoded row by row into a
 *     strip (192 KiB, in L2), then the block's tile loads and steps (the kernel before
 *     2026-12-07 11:40), with and without a prefetch of the next block;
 *   - "ring D": group q decoded into a ring of D slots of 3 KiB (in L1) while group
 *     q - D + 1's tiles are loaded and stepped, with and without a prefetch 256 B ahead;
 *     "decode only" drops the tile operations, "tiles only" the decode.
 * Argument: the matrix's rows (96: in L2; more for L3, and past the L3's size for DRAM).
 * GMAC/s counts one token's multiply-adds. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static uint16_t tbl[256][32] __attribute__((aligned(64)));
static uint16_t bb[16 * 32 * 4096] __attribute__((aligned(64)));
static uint16_t ring[64][3][512] __attribute__((aligned(64)));
static uint16_t strip[64][3][512] __attribute__((aligned(64)));
static inline __m512i dec(const uint8_t *p, uint8_t s) {
  __m512i t = _mm512_load_si512(tbl[s]);
  __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm512_permutexvar_epi16(_mm512_or_si512(c, _mm512_slli_epi32(c, 12)), t);
}
int ROWS = 3072, K = 3584;
/* mode 0: strip per block (row-outer), then tile ops. mode 1: fused ring, depth D. mode 2: decode only (ring). mode 3: tiles only */
static double run(const uint8_t *codes, const uint8_t *sc, int mode, int D, int pfd, int reps) {
  int G = K / 32, rb = K / 2;
  double t = now();
  for (int rep = 0; rep < reps; rep++)
  for (int r0 = 0; r0 + 48 <= ROWS; r0 += 48) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2);
    if (mode == 0) {
      for (int q0 = 0; q0 < G; q0 += 64) {
        int q1 = q0 + 64 < G ? q0 + 64 : G;
        for (int t = 0; t < 3; t++) for (int i = 0; i < 16; i++) {
          int r = r0 + t * 16 + i;
          for (int q = q0; q < q1; q++) {
            const uint8_t *p = codes + (size_t)r * rb + q * 16;
            if (pfd) _mm_prefetch((const char *)p + pfd, _MM_HINT_T0);
            _mm512_store_si512(&strip[q - q0][t][i * 32], dec(p, sc[(size_t)r * G + q]));
          }
        }
        for (int q = q0; q < q1; q++) {
          _tile_loadd(6, bb + q * 512, 12);
          _tile_loadd(3, strip[q - q0][0], 64); _tile_loadd(4, strip[q - q0][1], 64); _tile_loadd(5, strip[q - q0][2], 64);
          _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 5, 6);
        }
      }
    } else {
      const uint8_t *pp[48], *ss[48];
      for (int j = 0; j < 48; j++) { pp[j] = codes + (size_t)(r0 + j) * rb; ss[j] = sc + (size_t)(r0 + j) * G; }
      int Dm = D - 1;
      for (int q = 0; q < G + D; q++) {
        if (q < G && mode != 3) {
          uint16_t *dst = ring[q & Dm][0];
          for (int j = 0; j < 48; j++) {
            const uint8_t *p = pp[j] + q * 16;
            if (pfd && (q & 3) == 0) _mm_prefetch((const char *)p + pfd, _MM_HINT_T0);
            _mm512_store_si512(dst + j * 32, dec(p, ss[j][q]));
          }
        }
        int c = q - D + 1;
        if (c >= 0 && c < G && mode != 2) {
          _tile_loadd(6, bb + c * 512, 12);
          _tile_loadd(3, ring[c & Dm][0], 64); _tile_loadd(4, ring[c & Dm][1], 64); _tile_loadd(5, ring[c & Dm][2], 64);
          _tile_dpbf16ps(0, 3, 6); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 5, 6);
        }
      }
    }
    _tile_stored(0, ring[63][0], 64);
  }
  double el = (now() - t) / reps;
  return (double)ROWS * K / el / 1e9;
}
int main(int argc, char **argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
  cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; i++) { c.colsb[i] = 64; c.rows[i] = 16; }
  c.colsb[0]=c.colsb[1]=c.colsb[2]=12; c.colsb[6]=12;
  _tile_loadconfig(&c);
  if (argc > 1) ROWS = atoi(argv[1]);
  size_t nb = (size_t)ROWS * K / 2;
  uint8_t *codes = aligned_alloc(4096, nb + 8192), *sc = aligned_alloc(4096, ROWS * K / 32 + 4096);
  for (size_t i = 0; i < nb + 8192; i++) codes[i] = rand();
  for (size_t i = 0; i < (size_t)ROWS * K / 32; i++) sc[i] = 118 + rand() % 4;
  for (int s = 0; s < 256; s++) for (int j = 0; j < 32; j++) tbl[s][j] = 0x3f00 + j;
  for (size_t i = 0; i < sizeof bb / 2; i++) bb[i] = 0x3f80;
  int reps = ROWS <= 512 ? 200 : 10;
  for (int round = 0; round < 2; round++) {
    printf("strip per block, pf 1024: %.1f GMAC/s\n", run(codes, sc, 0, 0, 1024, reps));
    printf("strip per block, no pf  : %.1f GMAC/s\n", run(codes, sc, 0, 0, 0, reps));
    int Ds[] = {1, 2, 4, 8};
    for (int d = 0; d < 4; d++) printf("ring D=%d pf 256: %.1f   no pf: %.1f   decode only: %.1f\n", Ds[d],
      run(codes, sc, 1, Ds[d], 256, reps), run(codes, sc, 1, Ds[d], 0, reps), run(codes, sc, 2, Ds[d], 256, reps));
    printf("tiles only: %.1f\n", run(codes, sc, 3, 4, 0, reps));
  }
  return 0;
}
