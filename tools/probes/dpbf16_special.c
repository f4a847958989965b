// vdpbf16ps on special inputs: which scalar model its bits follow when inputs, the
// accumulator or results are subnormal, when a product underflows, near the smallest
// normal (tininess before or after rounding), on overflow, and with NaN and Inf.
//
// Every case runs one zmm instruction and compares each lane with scalar models built
// from fmaf (one rounding per product step: the product of two bf16 is exact, so an FMA
// is what "acc += a*b" rounded once means), odd element first (Intel's pseudo-code):
//   ref:      t = daz(acc); t = ftz(fma(daz(a1), daz(b1), t)); t = ftz(fma(daz(a0), daz(b0), t))
// where daz maps a subnormal to a zero of its sign and ftz maps a result that is tiny AFTER
// rounding (rounded to 24 bits with an unbounded exponent, below 2^-126) to a zero of its
// sign; and variants that each drop one ingredient, to show which ones the hardware has.
// Prints, per category, how many lanes each model matches.
//
//   gcc -O2 -mavx512f -mavx512bf16 -mfma dpbf16_special.c -o /tmp/dpbf16_special -lm
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint64_t s = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s; }
static float f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static float bf(uint16_t h) { return f32((uint32_t)h << 16); }
static int sub(float x) { return fpclassify(x) == FP_SUBNORMAL; }
static float daz(float x) { return sub(x) ? copysignf(0.f, x) : x; }

// Flush a tiny result: tininess before rounding (the exact value below 2^-126) or after
// (the value rounded to 24 bits with an unbounded exponent below 2^-126).
static float fma_ftz(float a, float b, float c, int after) {
  float r = fmaf(a, b, c);
  // Exact whenever the result can be tiny: then |a*b| and |c| are within 2^53 of each
  // other or the sum is dominated by a term below 2^-126 (the cases generated here).
  double exact = (double)a * (double)b + (double)c;
  int tiny;
  if (after) {
    // Rounded to 24 bits in the normal range (scaled by 2^100, exact), then compared.
    tiny = exact != 0 && fabs((double)(float)(exact * 0x1p100)) < 0x1p-26;
  } else {
    tiny = exact != 0 && fabs(exact) < 0x1p-126;
  }
  if (tiny) return copysignf(0.f, (float)exact);
  return r;
}

enum { REF, NO_DAZ_IN, NO_DAZ_ACC, NO_FTZ_MID, NO_FTZ_OUT, EVEN_FIRST, TINY_BEFORE, NMODELS };
static const char *names[NMODELS] = {"ref", "no-daz-on-bf16", "no-daz-on-acc", "no-ftz-between",
                                     "no-ftz-at-end", "even-first", "tiny-before-rounding"};

static float model(int m, float acc, float a0, float b0, float a1, float b1) {
  int dz = m != NO_DAZ_IN, da = m != NO_DAZ_ACC, after = m != TINY_BEFORE;
  float t = da ? daz(acc) : acc;
  float x0 = dz ? daz(a0) : a0, y0 = dz ? daz(b0) : b0, x1 = dz ? daz(a1) : a1, y1 = dz ? daz(b1) : b1;
  if (m == EVEN_FIRST) { float u = x0; x0 = x1; x1 = u; u = y0; y0 = y1; y1 = u; }
  if (m == NO_FTZ_MID) t = fmaf(x1, y1, t); else t = fma_ftz(x1, y1, t, after);
  if (m == NO_FTZ_OUT) t = fmaf(x0, y0, t); else t = fma_ftz(x0, y0, t, after);
  return t;
}

static int same(float a, float b) { return bits(a) == bits(b) || (isnan(a) && isnan(b)); }

typedef void (*gen_fn)(uint16_t *a, uint16_t *b, float *acc);

static uint16_t bfrand(int emin, int emax) {
  int e = emin + (int)(rnd() % (uint64_t)(emax - emin + 1));
  return (uint16_t)((rnd() & 0x807f) | (e << 7));
}
static uint16_t bfsub(void) { return (uint16_t)((rnd() & 0x807f) | 1); } // exponent 0, mantissa != 0

static void g_sub_inputs(uint16_t *a, uint16_t *b, float *acc) {
  for (int i = 0; i < 32; i++) {
    a[i] = rnd() % 3 ? bfrand(100, 150) : bfsub();
    b[i] = rnd() % 3 ? bfrand(100, 150) : bfsub();
  }
  for (int i = 0; i < 16; i++) acc[i] = 0x1p-140f * (float)(rnd() % 100); // subnormal or 0 acc
}
static void g_sub_acc(uint16_t *a, uint16_t *b, float *acc) {
  // products 2^-130..2^-115 (either sign), so that a kept subnormal accumulator would show
  for (int i = 0; i < 32; i++) { a[i] = bfrand(60, 67); b[i] = bfrand(60, 70); }
  for (int i = 0; i < 16; i++) acc[i] = f32((uint32_t)(rnd() & 0x807fffff) | 1);  // subnormal acc
}
static void g_sub_results(uint16_t *a, uint16_t *b, float *acc) {
  // products 2^-150..2^-124, acc 0 or a tiny normal of either sign
  for (int i = 0; i < 32; i++) { a[i] = bfrand(60, 70); b[i] = bfrand(45, 60); }
  for (int i = 0; i < 16; i++) acc[i] = rnd() % 2 ? 0.f : f32((uint32_t)(rnd() & 0x807fffff) | (1u << 23));
}
static void g_underflow_products(uint16_t *a, uint16_t *b, float *acc) {
  // products below 2^-149 added to normal accumulators (they round away or to an ulp)
  for (int i = 0; i < 32; i++) { a[i] = bfrand(1, 60); b[i] = bfrand(1, 60); }
  for (int i = 0; i < 16; i++) acc[i] = f32((uint32_t)(rnd() & 0x807fffff) | ((uint32_t)(1 + rnd() % 3) << 23));
}
static void g_boundary(uint16_t *a, uint16_t *b, float *acc) {
  // acc just above the smallest normal, products that take it just below (within an ulp)
  for (int i = 0; i < 16; i++) {
    acc[i] = f32((1u << 23) | (uint32_t)(rnd() % 4)) * (rnd() % 2 ? 1 : -1);
    float sign = acc[i] > 0 ? -1.f : 1.f;
    int e = 127 - 77 - (int)(rnd() % 8); // a = 2^-77.., b ~ 2^-(70..78)
    uint16_t x = (uint16_t)((rnd() & 0x7f) | (50 << 7));
    uint16_t y = (uint16_t)((rnd() & 0x7f) | (e << 7) | (sign < 0 ? 0x8000 : 0));
    a[2 * i + 1] = x; b[2 * i + 1] = y;
    a[2 * i] = rnd() % 2 ? 0 : (uint16_t)((rnd() & 0x7f) | (40 << 7));
    b[2 * i] = (uint16_t)((rnd() & 0x807f) | ((int)(40 + rnd() % 10) << 7));
  }
}
static void g_overflow(uint16_t *a, uint16_t *b, float *acc) {
  for (int i = 0; i < 32; i++) { a[i] = bfrand(190, 254); b[i] = bfrand(190, 254); }
  for (int i = 0; i < 16; i++) acc[i] = f32((uint32_t)(rnd() & 0x807fffff) | (254u << 23));
}
static void g_nan_inf(uint16_t *a, uint16_t *b, float *acc) {
  const uint16_t sp[] = {0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81, 0x0000, 0x8000, 0x3f80};
  for (int i = 0; i < 32; i++) {
    a[i] = rnd() % 2 ? sp[rnd() % 8] : bfrand(100, 150);
    b[i] = rnd() % 2 ? sp[rnd() % 8] : bfrand(100, 150);
  }
  const uint32_t sa[] = {0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0, 0x80000000};
  for (int i = 0; i < 16; i++) acc[i] = rnd() % 2 ? f32(sa[rnd() % 6]) : 1.f;
}
static void g_zero_sign(uint16_t *a, uint16_t *b, float *acc) {
  for (int i = 0; i < 32; i++) { a[i] = rnd() % 2 ? 0x8000 : bfrand(100, 150); b[i] = rnd() % 2 ? 0 : bfrand(100, 150); }
  for (int i = 0; i < 16; i++) acc[i] = rnd() % 2 ? -0.f : 0.f;
}
static void g_normal(uint16_t *a, uint16_t *b, float *acc) {
  for (int i = 0; i < 32; i++) { a[i] = bfrand(100, 140); b[i] = bfrand(100, 140); }
  for (int i = 0; i < 16; i++) acc[i] = f32((uint32_t)(rnd() & 0x807fffff) | ((uint32_t)(100 + rnd() % 40) << 23));
}

int main(void) {
  struct { const char *name; gen_fn g; long iters; } cats[] = {
      {"normal", g_normal, 100000},           {"subnormal bf16 inputs", g_sub_inputs, 100000},
      {"subnormal accumulator", g_sub_acc, 100000}, {"subnormal results", g_sub_results, 100000},
      {"products below 2^-149", g_underflow_products, 100000}, {"results at 2^-126", g_boundary, 200000},
      {"overflow", g_overflow, 50000},        {"NaN/Inf", g_nan_inf, 50000},
      {"signed zeros", g_zero_sign, 50000},
  };
  int ncats = sizeof cats / sizeof cats[0];
  int all_ref = 1;
  for (int c = 0; c < ncats; c++) {
    long n = 0, hit[NMODELS] = {0}, flushed = 0, subres = 0;
    uint32_t nan_bits[4] = {0}; int nnan = 0;
    for (long it = 0; it < cats[c].iters; it++) {
      uint16_t a[32], b[32]; float acc[16], r[16];
      cats[c].g(a, b, acc);
      __m512bh X, Y; memcpy(&X, a, 64); memcpy(&Y, b, 64);
      _mm512_storeu_ps(r, _mm512_dpbf16_ps(_mm512_loadu_ps(acc), X, Y));
      for (int j = 0; j < 16; j++) {
        n++;
        float a0 = bf(a[2 * j]), b0 = bf(b[2 * j]), a1 = bf(a[2 * j + 1]), b1 = bf(b[2 * j + 1]);
        for (int m = 0; m < NMODELS; m++) hit[m] += same(r[j], model(m, acc[j], a0, b0, a1, b1));
        float plain = fmaf(a0, b0, fmaf(a1, b1, acc[j]));
        if (sub(plain)) { subres++; if (r[j] == 0) flushed++; }
        if (isnan(r[j]) && nnan < 4) { int k; for (k = 0; k < nnan && nan_bits[k] != bits(r[j]); k++); if (k == nnan) nan_bits[nnan++] = bits(r[j]); }
      }
    }
    printf("%-24s lanes %8ld:", cats[c].name, n);
    for (int m = 0; m < NMODELS; m++) printf(" %s %.5f;", names[m], (double)hit[m] / n);
    if (subres) printf(" [plain-fma subnormal results %ld, hardware gave 0 for %ld]", subres, flushed);
    if (nnan) { printf(" [NaN bits:"); for (int k = 0; k < nnan; k++) printf(" %08x", nan_bits[k]); printf("]"); }
    printf("\n");
    if (hit[REF] != n) all_ref = 0;
  }
  printf("ref model bit-exact in every category: %s\n", all_ref ? "YES" : "NO");
  return 0;
}
