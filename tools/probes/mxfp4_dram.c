/* The one-token MXFP4 loop (R rows side by side, the kernel's decode) over a routed
 * expert's short rows (3584 columns: 1792 bytes of codes a row) from DRAM, one thread, by
 * prefetch: none, each row's own line a distance ahead, or the next row tile's lines (the
 * same line of each of its rows, or its bytes in order). Also the loop on cached rows,
 * and the same loads without the decode. See README.md. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#ifndef R
#define R 4
#endif
#define G 112 /* groups of 32 columns a row */
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static const float E2M1[16]={0,0.5,1,1.5,2,3,4,6,-0.0,-0.5,-1,-1.5,-2,-3,-4,-6};
static float T32[256][16] __attribute__((aligned(64)));
static float sink;
enum { NONE, OWN_T0, OWN_T1, NEXT_ROWS, NEXT_BYTES };
/* Rows of G groups (16 bytes of codes each), their scale bytes apart. */
__attribute__((noinline)) static double run(const uint8_t*codes,const uint8_t*sc,const float*x,
    long nrows,int kind,int dist,int decode){
  double t0=now(); __m512 tot=_mm512_setzero_ps();
  for(long r=0;r+R<=nrows;r+=R){
    __m512 acc[R][2];
    for(int j=0;j<R;j++){acc[j][0]=_mm512_setzero_ps();acc[j][1]=_mm512_setzero_ps();}
    for(int q=0;q<G;q+=4){ /* one 64-byte line of every row */
      for(int j=0;j<R;j++){
        const char*own=(const char*)codes+((r+j)*G+q)*16;
        const char*nrow=(const char*)codes+((r+R+j)*G+q)*16;
        const char*nbytes=(const char*)codes+(r+R)*G*16+((long)q/4*R+j)*64;
        switch(kind){
          case OWN_T0: _mm_prefetch(own+dist,_MM_HINT_T0); break;
          case OWN_T1: _mm_prefetch(own+dist,_MM_HINT_T1); break;
          case NEXT_ROWS: _mm_prefetch(nrow,_MM_HINT_T0); break;
          case NEXT_BYTES: _mm_prefetch(nbytes,_MM_HINT_T0); break;
        }
      }
      for(int u=0;u<4;u++){
        int g=q+u;
        __m512 x0=_mm512_load_ps(x+32*g), x1=_mm512_load_ps(x+32*g+16);
        for(int j=0;j<R;j++){
          const uint8_t*p=codes+((r+j)*G+g)*16;
          __m512 lo,hi;
          if(decode){
            __m512 tbl=_mm512_load_ps(T32[sc[(r+j)*G+g]]);
            __m512i c=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
            lo=_mm512_permutexvar_ps(c,tbl); hi=_mm512_permutexvar_ps(_mm512_srli_epi32(c,4),tbl);
          } else {
            lo=_mm512_castsi512_ps(_mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p))); hi=lo;
          }
          acc[j][0]=_mm512_fmadd_ps(lo,x0,acc[j][0]); acc[j][1]=_mm512_fmadd_ps(hi,x1,acc[j][1]);
        }
      }
    }
    for(int j=0;j<R;j++) tot=_mm512_add_ps(tot,_mm512_add_ps(acc[j][0],acc[j][1]));
  }
  sink+=_mm512_reduce_add_ps(tot);
  return now()-t0;
}
int main(int argc,char**argv){
  long bytes=(argc>1?atol(argv[1]):512)<<20; /* MiB of codes (10x the L3 or more) */
  for(int s=0;s<256;s++) for(int n=0;n<16;n++) T32[s][n]=ldexpf(E2M1[n],s-127);
  long nrows=bytes/(G*16)/R*R;
  uint8_t*codes=aligned_alloc(64,(nrows+2*R)*G*16); uint8_t*sc=aligned_alloc(64,(nrows+2*R)*G);
  float*x=aligned_alloc(64,G*32*4);
  for(long i=0;i<(nrows+2*R)*G*16;i++) codes[i]=(uint8_t)((uint64_t)i*2654435761u>>24);
  for(long i=0;i<(nrows+2*R)*G;i++) sc[i]=118+i%4;
  for(int i=0;i<G*32;i++) x[i]=(i%13)*0.1f;
  struct {const char*n;int kind,dist;} v[]={{"none",NONE,0},{"own line T0 +256",OWN_T0,256},
    {"own line T0 +1024",OWN_T0,1024},{"own line T0 +2048",OWN_T0,2048},
    {"own line T1 +256",OWN_T1,256},{"own line T1 +4096",OWN_T1,4096},
    {"next tile's rows",NEXT_ROWS,0},{"next tile's bytes",NEXT_BYTES,0}};
  double gm=(double)nrows*G*32/1e9, gb=(double)nrows*G*17/1e9; /* MACs; codes + scales */
  for(int round=0;round<2;round++){
    double tc=1e9; long small=64; /* 114 KB: L2 */
    for(int k=0;k<50;k++){ double t=run(codes,sc,x,small,NONE,0,1); if(t<tc) tc=t; }
    printf("R=%d cached rows:           %5.1f GMAC/s\n",R,(double)small*G*32/tc/1e9);
    double tr=run(codes,sc,x,nrows,NEXT_ROWS,0,0);
    printf("R=%d DRAM, loads only:      %5.1f GB/s\n",R,gb/tr);
    for(unsigned i=0;i<sizeof v/sizeof v[0];i++){
      double t=run(codes,sc,x,nrows,v[i].kind,v[i].dist,1);
      printf("R=%d DRAM, %-19s %5.1f GMAC/s %5.1f GB/s\n",R,v[i].n,gm/t,gb/t);
    }
  }
  printf("checksum %f\n",sink);
  return 0;
}
