/* AMX-BF16 TDPBF16PS throughput, tiles reloaded from L1 every step (see README.md). */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <time.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
int main(){
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) { perror("arch_prctl"); return 1; }
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int i=0;i<8;i++){ c.colsb[i]=64; c.rows[i]=16; }
  _tile_loadconfig(&c);
  static uint16_t A[2][16*32] __attribute__((aligned(64))), B[4][16*32] __attribute__((aligned(64)));
  static float C[4][16*16] __attribute__((aligned(64)));
  for(int i=0;i<16*32;i++){ for(int k=0;k<2;k++) A[k][i]=0x3f80+(i%5); for(int k=0;k<4;k++) B[k][i]=0x3f00+(i%3);}  
  // 2 A tiles (tmm4,5) x 2 B tiles (tmm6,7) -> 4 C tiles (tmm0..3): 4 TDPBF16PS per step
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  long n=5000000; double t=now();
  for(long i=0;i<n;i++){
    _tile_loadd(4, A[0], 64); _tile_loadd(5, A[1], 64);
    _tile_loadd(6, B[0], 64); _tile_loadd(7, B[1], 64);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
  }
  double dt=now()-t;
  _tile_stored(0,C[0],64);
  printf("AMX bf16: %.1f GMAC/s per core (%.1f MAC/cycle at 3.55 GHz)  %f\n", n*4*8192.0/dt/1e9, n*4*8192.0/dt/3.55e9, C[0][0]);
  _tile_release();
}
