// vdpbf16ps: throughput and which scalar model its bits follow.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
static uint64_t s=88172645463325252ull;
static uint64_t rnd(){s^=s<<13;s^=s>>7;s^=s<<17;return s;}
static float f32(uint32_t b){float f;memcpy(&f,&b,4);return f;}
static uint32_t bits(float f){uint32_t b;memcpy(&b,&f,4);return b;}
static float bf(uint16_t h){return f32((uint32_t)h<<16);}
static float daz(float x){ return (fpclassify(x)==FP_SUBNORMAL)? copysignf(0.f,x):x; }
static float ftz(float x){ return daz(x); }
int main(int argc,char**argv){
  // bits
  long n=0, m[6]={0};
  for(int it=0;it<200000;it++){
    uint16_t a[32],b[32]; float acc[16];
    for(int i=0;i<32;i++){ int e=100+rnd()%40; a[i]=(rnd()&0x807f)|(e<<7); e=100+rnd()%40; b[i]=(rnd()&0x807f)|(e<<7);}
    for(int i=0;i<16;i++){ int e=100+rnd()%40; acc[i]=f32((rnd()&0x807fffff)|((uint32_t)e<<23)); }
    __m512 A=_mm512_loadu_ps(acc); __m512bh X,Y; memcpy(&X,a,64); memcpy(&Y,b,64);
    __m512 R=_mm512_dpbf16_ps(A,X,Y); float r[16]; _mm512_storeu_ps(r,R);
    for(int j=0;j<16;j++){
      float p0=bf(a[2*j])*bf(b[2*j]), p1=bf(a[2*j+1])*bf(b[2*j+1]);
      float m0 = ftz(ftz(acc[j]+p1)+p0);          // odd then even (Intel pseudo-code)
      float m1 = ftz(ftz(acc[j]+p0)+p1);          // even then odd
      float m2 = ftz(acc[j]+(float)((double)p0+(double)p1)); // pair rounded then add
      float m3 = (float)((double)acc[j]+(double)p0+(double)p1); // one rounding (approx)
      float m4 = ftz(acc[j]+ (p0+p1));
      n++; if(bits(r[j])==bits(m0))m[0]++; if(bits(r[j])==bits(m1))m[1]++; if(bits(r[j])==bits(m2))m[2]++; if(bits(r[j])==bits(m3))m[3]++; if(bits(r[j])==bits(m4))m[4]++;
    }
  }
  printf("n=%ld odd-then-even %.4f even-then-odd %.4f pair-f64-then-add %.4f one-rounding %.4f pair-f32-then-add %.4f\n",n,(double)m[0]/n,(double)m[1]/n,(double)m[2]/n,(double)m[3]/n,(double)m[4]/n);
  // rate: 12 independent accumulators
  __m512 acc[12]; for(int i=0;i<12;i++) acc[i]=_mm512_setzero_ps();
  __m512bh x,y; uint16_t buf[32]; for(int i=0;i<32;i++) buf[i]=0x3f80; memcpy(&x,buf,64); memcpy(&y,buf,64);
  long iters=100000000/12; struct timespec t0,t1; clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<iters;i++){
    #pragma GCC unroll 12
    for(int k=0;k<12;k++) acc[k]=_mm512_dpbf16_ps(acc[k],x,y);
    __asm__ volatile("" : "+v"(acc[0]),"+v"(acc[1]),"+v"(acc[2]),"+v"(acc[3]),"+v"(acc[4]),"+v"(acc[5]),"+v"(acc[6]),"+v"(acc[7]),"+v"(acc[8]),"+v"(acc[9]),"+v"(acc[10]),"+v"(acc[11]));
  }
  clock_gettime(CLOCK_MONOTONIC,&t1); double dt=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9;
  double ops=(double)iters*12; printf("vdpbf16ps zmm: %.2f G/s = %.1f GMAC/s (products) one core\n", ops/dt/1e9, ops*32/dt/1e9);
  // FMA rate for comparison
  __m512 f[12]; for(int i=0;i<12;i++) f[i]=_mm512_set1_ps(1.0f); __m512 a1=_mm512_set1_ps(1.0000001f), b1=_mm512_set1_ps(0.999999f);
  clock_gettime(CLOCK_MONOTONIC,&t0);
  for(long i=0;i<iters;i++){
    #pragma GCC unroll 12
    for(int k=0;k<12;k++) f[k]=_mm512_fmadd_ps(f[k],a1,b1);
    __asm__ volatile("" : "+v"(f[0]),"+v"(f[1]),"+v"(f[2]),"+v"(f[3]),"+v"(f[4]),"+v"(f[5]),"+v"(f[6]),"+v"(f[7]),"+v"(f[8]),"+v"(f[9]),"+v"(f[10]),"+v"(f[11]));
  }
  clock_gettime(CLOCK_MONOTONIC,&t1); dt=(t1.tv_sec-t0.tv_sec)+(t1.tv_nsec-t0.tv_nsec)*1e-9;
  printf("vfmadd zmm: %.2f G/s = %.1f GMAC/s one core\n", ops/dt/1e9, ops*16/dt/1e9);
  float sink=0; float r[16]; _mm512_storeu_ps(r,acc[3]); sink+=r[0]; _mm512_storeu_ps(r,f[5]); sink+=r[1]; printf("%g\n",sink);
}
