/* Does TDPBF16PS equal a scalar model of its sums, bit for bit? (see README.md) */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
static uint64_t s=88172645463325252ull; static uint64_t rnd(){s^=s<<13;s^=s>>7;s^=s<<17;return s;}
static float bf(uint16_t h){uint32_t u=(uint32_t)h<<16; float f; memcpy(&f,&u,4); return f;}
/* Random normal bf16 with exponents 122..129: every product then sits within about 40
   bits of the others, so the double sums of the models below are exact. */
static uint16_t rbf(){
  uint16_t e = 122 + rnd()%8; uint16_t m=rnd()&0x7f; uint16_t sg=rnd()&1; return (sg<<15)|(e<<7)|m; }
int main(){
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) { perror("arch_prctl"); return 1; }
  cfg_t c; memset(&c,0,sizeof c); c.palette=1; for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  _tile_loadconfig(&c);
  static uint16_t A[16*32] __attribute__((aligned(64))), B[16*32] __attribute__((aligned(64)));
  static float C[16*16] __attribute__((aligned(64))), C0[16*16];
  long agree[4]={0,0,0,0}, total=0;
  for(int trial=0; trial<2000; trial++){
    for(int i=0;i<16*32;i++){A[i]=rbf();B[i]=rbf();}
    for(int i=0;i<256;i++){ uint16_t h=rbf(); C0[i]=bf(h)*(float)(1+(rnd()%1000)); }
    memcpy(C,C0,sizeof C);
    _tile_loadd(0,C,64); _tile_loadd(1,A,64); _tile_loadd(2,B,64);
    _tile_dpbf16ps(0,1,2); _tile_stored(0,C,64);
    for(int m=0;m<16;m++) for(int n=0;n<16;n++){
      float e1=C0[m*16+n], e2=C0[m*16+n]; double e3=C0[m*16+n]; float e3f=e3;
      for(int k=0;k<16;k++){
        float a0=bf(A[m*32+2*k]), a1=bf(A[m*32+2*k+1]), b0=bf(B[k*32+2*n]), b1=bf(B[k*32+2*n+1]);
        e1 = fmaf(a0,b0,e1); e1 = fmaf(a1,b1,e1);                 // sequential FMAs
        e2 = e2 + (float)((double)a0*b0 + (double)a1*b1);         // pair summed first (rounded once), then added
        e3f = (float)((double)e3f + (double)a0*b0 + (double)a1*b1); // acc+p0+p1 in double, rounded once per k (approx exact)
      }
      double all=C0[m*16+n]; for(int k=0;k<16;k++){ all += (double)bf(A[m*32+2*k])*bf(B[k*32+2*n]) + (double)bf(A[m*32+2*k+1])*bf(B[k*32+2*n+1]); } float e4=(float)all;
      float h=C[m*16+n]; total++; if(memcmp(&h,&e4,4)==0)agree[3]++;
      if(memcmp(&h,&e1,4)==0)agree[0]++; if(memcmp(&h,&e2,4)==0)agree[1]++; if(memcmp(&h,&e3f,4)==0)agree[2]++;
    }
  }
  printf("of %ld outputs: sequential fma %ld, pair-then-add %ld, one rounding per k %ld, one rounding overall %ld\n", total, agree[0], agree[1], agree[2], agree[3]);
  _tile_release();
}
