/* FMAs that each load a new 64-byte line from an N KiB buffer (see README.md). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  long kb=atol(argv[1]); long nf=kb*1024/4;
  float *b=aligned_alloc(64,nf*4); for(long i=0;i<nf;i++)b[i]=i*1e-6f;
  __m512 a[16]; for(int i=0;i<16;i++)a[i]=_mm512_set1_ps(i+argc);
  __m512 x=_mm512_set1_ps(argc*0.999f);
  long total=800000000/16; long per=nf/256; // iterations of 16 loads per pass
  double t=now(); long it=0;
  while(it<total){
    for(long j=0;j<per;j++){
      const float*p=b+j*256;
#define F(k) a[k]=_mm512_fmadd_ps(_mm512_load_ps(p+16*k),x,a[k]);
      F(0)F(1)F(2)F(3)F(4)F(5)F(6)F(7)F(8)F(9)F(10)F(11)F(12)F(13)F(14)F(15)
    }
    it+=per;
  }
  double dt=now()-t; __m512 s=a[0]; for(int i=1;i<16;i++)s=_mm512_add_ps(s,a[i]);
  printf("%ld KB: %.2f G FMA/s (%.2f per cycle at 3.55, %.1f B/cycle)  %f\n", kb, it*16/dt/1e9, it*16/dt/1e9/3.55, it*16*64/dt/1e9/3.55, _mm512_reduce_add_ps(s));
}
