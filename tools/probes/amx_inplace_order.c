/* 16 tokens (three activation tiles of 16 part columns) against a BF16 7168-column matrix
 * read in place from DRAM (rows 14336 bytes apart), one thread, by loop order (see
 * README.md):
 *   - "pairs": two row tiles against the first two token tiles, then the same two row
 *     tiles (now in L2) against the third: every weight tile loaded twice, 32 rows walked
 *     at once (the AMX kernel's order before 2026-12-07 17:00);
 *   - "rows, chunk C": one row tile at a time against all three token tiles, each weight
 *     tile loaded once, in chunks of C row tiles a 2048-column block at a time (the kernel
 *     after: C = 2).
 * Run two copies at once for the two-thread picture. Prints GB/s of weights. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define K 7168
#define G (K / 32)
#define RS (K * 2)
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static uint8_t bt[3][G][1024] __attribute__((aligned(64)));
static float cst[256] __attribute__((aligned(64)));
static int ROWS = 8192;
static void row_tile(const uint8_t *a, int q0, int q1) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2);
  for (int q = q0; q < q1; q++) {
    _tile_loadd(4, a + q * 64, RS);
    _tile_loadd(5, bt[0][q], 64); _tile_loadd(6, bt[1][q], 64); _tile_loadd(7, bt[2][q], 64);
    _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7);
  }
  _tile_stored(0, cst, 64); _tile_stored(1, cst, 64); _tile_stored(2, cst, 64);
}
static void pairs(const uint8_t *a0, int q0, int q1) {
  const uint8_t *a1 = a0 + 16 * (size_t)RS;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int q = q0; q < q1; q++) {
    _tile_loadd(4, a0 + q * 64, RS); _tile_loadd(5, a1 + q * 64, RS);
    _tile_loadd(6, bt[0][q], 64); _tile_loadd(7, bt[1][q], 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, cst, 64); _tile_stored(1, cst, 64); _tile_stored(2, cst, 64); _tile_stored(3, cst, 64);
  _tile_zero(0); _tile_zero(1);
  for (int q = q0; q < q1; q++) {
    _tile_loadd(4, a0 + q * 64, RS); _tile_loadd(5, a1 + q * 64, RS);
    _tile_loadd(6, bt[2][q], 64);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
  }
  _tile_stored(0, cst, 64); _tile_stored(1, cst, 64);
}
/* chunk 0: pairs; else rows in chunks of `chunk` row tiles. */
static double run(const uint8_t *w, int chunk) {
  int c = chunk ? chunk : 2;
  double t = now();
  for (int r0 = 0; r0 + 16 * c <= ROWS; r0 += 16 * c)
    for (int q0 = 0; q0 < G; q0 += 64) {
      int q1 = q0 + 64 < G ? q0 + 64 : G;
      if (!chunk) pairs(w + (size_t)r0 * RS, q0, q1);
      else for (int i = 0; i < c; i++) row_tile(w + (size_t)(r0 + 16 * i) * RS, q0, q1);
    }
  return (double)ROWS * RS / (now() - t) / 1e9;
}
int main(int argc, char **argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
  cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; i++) { c.colsb[i] = 64; c.rows[i] = 16; }
  _tile_loadconfig(&c);
  if (argc > 1) ROWS = atoi(argv[1]);
  size_t nb = (size_t)ROWS * RS;
  uint8_t *w = aligned_alloc(4096, nb);
  for (size_t i = 0; i < nb; i += 2) { w[i] = 0; w[i + 1] = 0x3f; }
  memset(bt, 0x3f, sizeof bt);
  for (int round = 0; round < 3; round++)
    printf("pairs %5.1f   rows, chunk 8 %5.1f   rows, chunk 2 %5.1f   rows, chunk 1 %5.1f GB/s\n",
           run(w, 0), run(w, 8), run(w, 2), run(w, 1));
  return 0;
}
