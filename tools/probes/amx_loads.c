/* AMX-BF16 tile loads against TDPBF16PS steps (see README.md): three weight tiles and
 * one activation tile (3 columns, the decode's shape) a step, the weight tiles read
 *   - back to back from L1 or L2, each tile's 16 rows contiguous (64 bytes apart),
 *   - from L2 or DRAM with the rows 14336 bytes apart (a 7168-column BF16 matrix read in
 *     place), advancing 64 bytes a step as the kernel walks a row's groups,
 *   - from DRAM contiguous (what a repacked trunk would give).
 * Also TDPBF16PS alone on one and on three accumulator chains. One thread. */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;

static double run(const uint8_t *base, size_t stride, size_t span, long n) {
  size_t off = 0, h = stride == 64 ? 1024 : 16 * stride;
  double t = now();
  for (long i = 0; i < n; i++) {
    const uint8_t *p = base + off;
    _tile_loadd(4, p, stride); _tile_loadd(5, p + h, stride); _tile_loadd(7, p + 2 * h, stride);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 7, 6);
    if (stride == 64) { off = (off + 3072) % (span - 3072); }
    else { off += 64; if (off % stride == 0) off += 47 * stride; if (off + 48 * stride + 64 > span) off = 0; }
  }
  return (now() - t) / n;
}

int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { perror("arch_prctl"); return 1; }
  cfg_t c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int i = 0; i < 8; i++) { c.colsb[i] = (i == 4 || i == 5 || i == 7) ? 64 : 12; c.rows[i] = 16; }
  _tile_loadconfig(&c);
  size_t mb = 1 << 20, big = 256 * mb;
  uint8_t *a = aligned_alloc(4096, big);
  for (size_t i = 0; i < big / 2; i++) ((uint16_t *)a)[i] = 0x3f80;
  static uint16_t b[16 * 32] __attribute__((aligned(64)));
  for (int i = 0; i < 16 * 32; i++) b[i] = 0x3f80;
  _tile_loadd(6, b, 12);
  _tile_zero(0); _tile_zero(1); _tile_zero(2);
  long n = 2000000;
  double t = now();
  for (long i = 0; i < n; i++) _tile_dpbf16ps(0, 4, 6);
  double one = (now() - t) / n;
  t = now();
  for (long i = 0; i < n / 3; i++) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6); _tile_dpbf16ps(2, 7, 6); }
  double three = (now() - t) / (n / 3 * 3);
  printf("TDPBF16PS alone: %.2f ns a step on one accumulator, %.2f on three\n", one * 1e9, three * 1e9);
  struct { const char *name; size_t stride, span; } cases[] = {
    {"contiguous, L1 (16 KiB)", 64, 16 * 1024}, {"contiguous, L2 (768 KiB)", 64, 768 * 1024},
    {"rows 14336 B apart, L2 (768 KiB)", 14336, 768 * 1024},
    {"rows 14336 B apart, DRAM (240 MiB)", 14336, 240 * mb},
    {"contiguous, DRAM (240 MiB)", 64, 240 * mb}};
  for (int k = 0; k < 5; k++) {
    double s = run(a, cases[k].stride, cases[k].span, 300000);
    printf("%-36s %6.1f ns a step of three tiles, %5.1f GB/s of weights\n", cases[k].name, s * 1e9, 3072 / s / 1e9);
  }
  _tile_release();
  return 0;
}
