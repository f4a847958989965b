#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <string.h>
#include <stdint.h>
#define N 16
__attribute__((noinline)) __m512 fma_loop(long it, __m512 a, __m512 b){
  __m512 f[N]; for(int i=0;i<N;i++) f[i]=_mm512_set1_ps(i);
  for(long i=0;i<it;i++){
    #pragma GCC unroll 16
    for(int k=0;k<N;k++) f[k]=_mm512_fmadd_ps(f[k],a,b);
  }
  __m512 s=f[0]; for(int i=1;i<N;i++) s=_mm512_add_ps(s,f[i]); return s;
}
__attribute__((noinline)) __m512 dp_loop(long it, __m512bh a, __m512bh b){
  __m512 f[N]; for(int i=0;i<N;i++) f[i]=_mm512_set1_ps(i);
  for(long i=0;i<it;i++){
    #pragma GCC unroll 16
    for(int k=0;k<N;k++) f[k]=_mm512_dpbf16_ps(f[k],a,b);
  }
  __m512 s=f[0]; for(int i=1;i<N;i++) s=_mm512_add_ps(s,f[i]); return s;
}
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long it=20000000; float o[16];
  double t0=now(); __m512 r=fma_loop(it,_mm512_set1_ps(1.0000001f),_mm512_set1_ps(1e-7f)); double t1=now();
  _mm512_storeu_ps(o,r); printf("fma  %.2f G/s (%.1f GMAC/s) %g\n", it*N/(t1-t0)/1e9, it*N*16/(t1-t0)/1e9, o[0]);
  uint16_t buf[32]; for(int i=0;i<32;i++) buf[i]=0x3f80; __m512bh x; memcpy(&x,buf,64);
  t0=now(); r=dp_loop(it,x,x); t1=now();
  _mm512_storeu_ps(o,r); printf("dpbf16 %.2f G/s (%.1f G products/s) %g\n", it*N/(t1-t0)/1e9, it*N*32/(t1-t0)/1e9, o[0]);
}
