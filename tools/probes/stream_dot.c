// One-token dot products streamed from memory, two shapes alternated in one process
// (issue 32: where the decode's BF16 products lose to llama.cpp's). 163 840 rows of 7168
// bf16 (the lm_head's 2.35 GB), split between threads, each thread taking its rows in
// order. Modes:
//   0: llama.cpp's shape: one row at a time, `vdpbf16ps` against a bf16 activation (14 KiB)
//   2: the exact kernel's shape: R rows side by side (R in 1, 2, 4, 8), each 64-byte line of
//      weights widened by a shift and an `and` into two f32 FMAs against an f32 activation
//      (28 KiB), PF bytes of software prefetch ahead in each row (0: none)
//   3: the exact shape on one row at a time, two lines a step (four accumulators)
// Prints GB/s of weights per pass; `MODES` "a,b" alternates a and b pass by pass (the
// memory's rate drifts within minutes on a VM, so only alternated passes compare).
//   gcc -O2 stream_dot.c -o /tmp/stream_dot -lpthread && /tmp/stream_dot 0,2 4 256 2
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define COLS 7168
#define ROWS 163840
static uint16_t *W;
static float X[COLS];
static uint16_t XB[COLS];
static int MODE, R, PF;
static volatile float out[ROWS];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    size_t r0, r1;
} task;

#define EXACT_R(RR)                                                                        \
    for (size_t r = t->r0; r + RR <= t->r1; r += RR) {                                     \
        __m512 a[RR][2];                                                                   \
        for (int j = 0; j < RR; j++) a[j][0] = a[j][1] = _mm512_setzero_ps();              \
        for (int c = 0; c < COLS; c += 32) {                                               \
            __m512 x0 = _mm512_loadu_ps(X + c), x1 = _mm512_loadu_ps(X + c + 16);          \
            for (int j = 0; j < RR; j++) {                                                 \
                const uint16_t *w = W + (r + j) * COLS + c;                                \
                if (PF) _mm_prefetch((const char *)w + PF, _MM_HINT_T0);                   \
                __m512i v = _mm512_loadu_si512(w);                                         \
                a[j][0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),   \
                                          x0, a[j][0]);                                    \
                a[j][1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, m)), x1, \
                                          a[j][1]);                                        \
            }                                                                              \
        }                                                                                  \
        for (int j = 0; j < RR; j++)                                                       \
            out[r + j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j][0], a[j][1]));            \
    }

__attribute__((target("avx512f,avx512bf16,avx512bw,fma"))) static void *run(void *p) {
    task *t = p;
    __m512i m = _mm512_set1_epi32((int)0xffff0000u);
    if (MODE == 0) {
        for (size_t r = t->r0; r < t->r1; r++) {
            const uint16_t *w = W + r * COLS;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            for (int c = 0; c < COLS; c += 64) {
                if (PF) _mm_prefetch((const char *)(w + c) + PF, _MM_HINT_T0);
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + c),
                                      (__m512bh)_mm512_loadu_si512(XB + c));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + c + 32),
                                      (__m512bh)_mm512_loadu_si512(XB + c + 32));
            }
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
    } else if (MODE == 3) {
        for (size_t r = t->r0; r < t->r1; r++) {
            const uint16_t *w = W + r * COLS;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < COLS; c += 64) {
                if (PF) _mm_prefetch((const char *)(w + c) + PF, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512(w + c), u = _mm512_loadu_si512(w + c + 32);
                a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                                     _mm512_loadu_ps(X + c), a0);
                a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, m)),
                                     _mm512_loadu_ps(X + c + 16), a1);
                a2 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)),
                                     _mm512_loadu_ps(X + c + 32), a2);
                a3 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(u, m)),
                                     _mm512_loadu_ps(X + c + 48), a3);
            }
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1),
                                                        _mm512_add_ps(a2, a3)));
        }
    } else if (R == 1) {
        EXACT_R(1)
    } else if (R == 2) {
        EXACT_R(2)
    } else if (R == 4) {
        EXACT_R(4)
    } else {
        EXACT_R(8)
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *modes = argc > 1 ? argv[1] : "0,2";
    R = argc > 2 ? atoi(argv[2]) : 4;
    PF = argc > 3 ? atoi(argv[3]) : 256;
    int th = argc > 4 ? atoi(argv[4]) : 2;
    if (th < 1 || th > 8) return 2;
    size_t n = (size_t)ROWS * COLS;
    W = aligned_alloc(64, n * 2);
    for (size_t i = 0; i < n; i++) W[i] = (uint16_t)(0x3f80 + (i & 63));
    for (int i = 0; i < COLS; i++) {
        X[i] = 1.0f;
        XB[i] = 0x3f80;
    }
    const char *second = strchr(modes, ',');
    for (int it = 0; it < 12; it++) {
        MODE = (second && (it & 1)) ? atoi(second + 1) : atoi(modes);
        double t0 = now();
        pthread_t p[8];
        task tk[8];
        for (int i = 0; i < th; i++) {
            tk[i].r0 = (size_t)ROWS * i / th;
            tk[i].r1 = (size_t)ROWS * (i + 1) / th;
            pthread_create(&p[i], 0, run, &tk[i]);
        }
        for (int i = 0; i < th; i++) pthread_join(p[i], 0);
        double dt = now() - t0, cs = 0;
        for (int i = 0; i < ROWS; i++) cs += out[i];
        printf("mode %d R %d pf %d th %d: %.1f GB/s (checksum %g)\n", MODE, R, PF, th,
               n * 2.0 / dt / 1e9, cs);
    }
    return 0;
}
