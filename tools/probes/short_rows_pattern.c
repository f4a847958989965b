/* Loads only (integer xor, no FMA: random bits as floats would take denormal assists):
 * contiguous rows of 1792 bytes (a routed expert's MXFP4 codes) read R rows side by side
 * 16 bytes a row a step, as the one-token MXFP4 kernels walk them, with or without the
 * next R rows' bytes prefetched (T1) in order over the R rows' steps. HUGE=1 in the
 * environment asks for transparent huge pages (MADV_HUGEPAGE) for the buffer. One thread;
 * see README.md. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <sys/mman.h>
#define RB 1792
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static long sink;
__attribute__((noinline)) static double run(const uint8_t*c,long nrows,int R,int pf){
  double t0=now(); __m128i a=_mm_setzero_si128();
  int per=(R*RB/64+111)/112;
  for(long r=0;r+R<=nrows;r+=R){
    const uint8_t*nx=c+(r+R)*RB;
    for(int q=0;q<112;q++){
      if(pf) for(int l=0;l<per;l++) _mm_prefetch((const char*)nx+(q*per+l)*64,_MM_HINT_T1);
      const uint8_t*p=c+r*RB+16*q;
      for(int j=0;j<R;j++) a=_mm_xor_si128(a,_mm_loadu_si128((const __m128i*)(p+j*RB)));
    }
  }
  sink+=_mm_cvtsi128_si64(a); return now()-t0;
}
int main(){
  long bytes=512l<<20; long nrows=bytes/RB; uint8_t*c=aligned_alloc(2<<20,bytes+(2<<20)); if(getenv("HUGE")) madvise(c,bytes+(2<<20),MADV_HUGEPAGE);
  for(long i=0;i<bytes+(1<<20);i++) c[i]=i*7;
  int Rs[]={1,4,16,48};
  for(int round=0;round<2;round++) for(int i=0;i<4;i++) for(int pf=0;pf<2;pf++){
    long n=nrows/Rs[i]*Rs[i]; double t=run(c,n,Rs[i],pf);
    printf("R=%2d pf=%d %5.1f GB/s\n",Rs[i],pf,n*RB/t/1e9);
  }
  printf("%ld\n",sink); return 0;
}
