// Probe: MXFP4 one-token decode, the current sequence (vpmovzxbd + 2 vpermps, f32 table per
// scale) against a VBMI one (vpermb spread, vpsrlvw, vpternlog, vpermb on a bf16 table per
// scale, then bf16 -> f32 by shift / and). 4 rows side by side, weights in L1/L2.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static const float E2M1[16]={0,0.5,1,1.5,2,3,4,6,-0.0,-0.5,-1,-1.5,-2,-3,-4,-6};
static float T32[256][16] __attribute__((aligned(64)));
static uint8_t T16[256][64] __attribute__((aligned(64)));
#define R 4
int main(int argc,char**argv){
  int G = argc>1?atoi(argv[1]):224; // groups per row (7168 cols)
  int iters = argc>2?atoi(argv[2]):20000;
  for(int s=0;s<256;s++) for(int n=0;n<16;n++){
    float v=ldexpf(E2M1[n], s-127); T32[s][n]=v; uint32_t b; memcpy(&b,&v,4);
    uint16_t h=b>>16; T16[s][n]=h&0xff; T16[s][16+n]=h>>8; T16[s][32+n]=h&0xff; T16[s][48+n]=h>>8; }
  uint8_t *codes=aligned_alloc(64,R*G*16); uint8_t *sc=aligned_alloc(64,R*G);
  float *x=aligned_alloc(64,G*32*4);
  srand(1); for(int i=0;i<R*G*16;i++) codes[i]=rand(); for(int i=0;i<R*G;i++) sc[i]=118+rand()%4;
  for(int i=0;i<G*32;i++) x[i]=(i%13)*0.1f;
  // spread: byte 4i..4i+3 <- code byte i; shifts per word: 0 (even word), 4 (odd word)
  uint8_t sp[64]; for(int i=0;i<64;i++) sp[i]=i/4;
  __m512i spread=_mm512_loadu_si512(sp);
  uint16_t shw[32]; for(int i=0;i<32;i++) shw[i]=(i&1)?4:0;
  __m512i shifts=_mm512_loadu_si512(shw);
  __m512i lowmask=_mm512_set1_epi8(0x0f);
  uint8_t of[64]; for(int i=0;i<64;i++) of[i]=(i&1)?16:0;
  __m512i offs=_mm512_loadu_si512(of);
  __m512i himask=_mm512_set1_epi32(0xffff0000);
  for(int mode=0;mode<2;mode++){
   double best=1e9; float chk=0;
   for(int rep=0;rep<3;rep++){
    double t0=now();
    __m512 acc[R][2];
    for(int it=0;it<iters;it++){
      for(int j=0;j<R;j++){acc[j][0]=_mm512_setzero_ps();acc[j][1]=_mm512_setzero_ps();}
      for(int q=0;q<G;q++){
        __m512 x0=_mm512_load_ps(x+32*q), x1=_mm512_load_ps(x+32*q+16);
        for(int j=0;j<R;j++){
          const uint8_t*p=codes+(j*G+q)*16; int s=sc[j*G+q];
          __m512 lo,hi;
          if(mode==0){
            __m512 tbl=_mm512_load_ps(T32[s]);
            __m512i c=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
            lo=_mm512_permutexvar_ps(c,tbl); hi=_mm512_permutexvar_ps(_mm512_srli_epi32(c,4),tbl);
          } else {
            __m512i c=_mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
            __m512i b=_mm512_permutexvar_epi8(spread,c);
            b=_mm512_srlv_epi16(b,shifts);
            b=_mm512_ternarylogic_epi32(b,lowmask,offs,0xEA); // (b & m) | o
            __m512i v=_mm512_permutexvar_epi8(b,_mm512_load_si512(T16[s]));
            lo=_mm512_castsi512_ps(_mm512_slli_epi32(v,16)); hi=_mm512_castsi512_ps(_mm512_and_si512(v,himask));
          }
          acc[j][0]=_mm512_fmadd_ps(lo,x0,acc[j][0]); acc[j][1]=_mm512_fmadd_ps(hi,x1,acc[j][1]);
        }
      }
    }
    double dt=now()-t0; if(dt<best)best=dt;
    float o[16]; chk=0; for(int j=0;j<R;j++){_mm512_storeu_ps(o,_mm512_add_ps(acc[j][0],acc[j][1])); for(int k=0;k<16;k++) chk+=o[k];}
   }
   double groups=(double)iters*G*R;
   printf("%s: %.2f ns/group-row, %.1f GMAC/s, %.1f GB/s of MXFP4, checksum %.6f\n", mode?"vbmi    ":"current ", best/groups*1e9, groups*32/best/1e9, groups*17/best/1e9, chk);
  }
  return 0;
}
