/* The batched kernel's register tile in every shape that fits the zmm registers (see README.md). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define NG 32
// W f32 staged: group q, row j: 32 floats at W + (q*R + j)*32
// X: token t: 1024 floats at X + t*XS
float *W; unsigned short *WB; float *X; long XS;
static float sink;
#define TILE(NAME,R,T) \
__attribute__((noinline)) void NAME(int reps, int tokens){ \
  for(int rep=0;rep<reps;rep++) for(int t0=0;t0+T<=tokens;t0+=T){ \
    __m512 a[R][T][2]; for(int j=0;j<R;j++)for(int t=0;t<T;t++){a[j][t][0]=_mm512_setzero_ps();a[j][t][1]=_mm512_setzero_ps();} \
    for(int q=0;q<NG;q++){ \
      __m512 x[T][2]; for(int t=0;t<T;t++){x[t][0]=_mm512_loadu_ps(X+(t0+t)*XS+32*q);x[t][1]=_mm512_loadu_ps(X+(t0+t)*XS+32*q+16);} \
      for(int j=0;j<R;j++){ __m512 w0=_mm512_load_ps(W+(q*R+j)*32), w1=_mm512_load_ps(W+(q*R+j)*32+16); \
        for(int t=0;t<T;t++){a[j][t][0]=_mm512_fmadd_ps(w0,x[t][0],a[j][t][0]);a[j][t][1]=_mm512_fmadd_ps(w1,x[t][1],a[j][t][1]);}} \
    } \
    __m512 s=_mm512_setzero_ps(); for(int j=0;j<R;j++)for(int t=0;t<T;t++)s=_mm512_add_ps(s,_mm512_add_ps(a[j][t][0],a[j][t][1])); sink+=_mm512_reduce_add_ps(s);} }
#define TILEB(NAME,R,T) \
__attribute__((noinline)) void NAME(int reps, int tokens){ __m512i m=_mm512_set1_epi32(0xFFFF0000); \
  for(int rep=0;rep<reps;rep++) for(int t0=0;t0+T<=tokens;t0+=T){ \
    __m512 a[R][T][2]; for(int j=0;j<R;j++)for(int t=0;t<T;t++){a[j][t][0]=_mm512_setzero_ps();a[j][t][1]=_mm512_setzero_ps();} \
    for(int q=0;q<NG;q++){ \
      __m512 x[T][2]; for(int t=0;t<T;t++){x[t][0]=_mm512_loadu_ps(X+(t0+t)*XS+32*q);x[t][1]=_mm512_loadu_ps(X+(t0+t)*XS+32*q+16);} \
      for(int j=0;j<R;j++){ __m512i v=_mm512_load_si512(WB+(q*R+j)*32); __m512 w0=_mm512_castsi512_ps(_mm512_slli_epi32(v,16)), w1=_mm512_castsi512_ps(_mm512_and_si512(v,m)); \
        for(int t=0;t<T;t++){a[j][t][0]=_mm512_fmadd_ps(w0,x[t][0],a[j][t][0]);a[j][t][1]=_mm512_fmadd_ps(w1,x[t][1],a[j][t][1]);}} \
    } \
    __m512 s=_mm512_setzero_ps(); for(int j=0;j<R;j++)for(int t=0;t<T;t++)s=_mm512_add_ps(s,_mm512_add_ps(a[j][t][0],a[j][t][1])); sink+=_mm512_reduce_add_ps(s);} }
TILE(f4x2,4,2) TILE(f6x2,6,2) TILE(f4x3,4,3) TILE(f3x4,3,4) TILE(f8x1,8,1) TILE(f2x6,2,6) TILE(f5x2,5,2)
TILEB(b4x2,4,2) TILEB(b6x2,6,2) TILEB(b4x3,4,3) TILEB(b8x1,8,1)
typedef void (*fn)(int,int);
int main(int argc,char**argv){
  W=aligned_alloc(64,8*NG*32*4); WB=aligned_alloc(64,8*NG*32*2);
  for(int i=0;i<8*NG*32;i++){W[i]=1e-3f*(i%17);WB[i]=0x3c00+(i%7);}
  long xs = argc>1? atol(argv[1]) : 1024; XS=xs;
  X=aligned_alloc(64, 16*xs*4+64); for(long i=0;i<16*xs;i++) X[i]=1.0f+i*1e-7f;
  struct {const char*n; fn f; int R,T;} v[]={{"f32 4x2",f4x2,4,2},{"f32 6x2",f6x2,6,2},{"f32 5x2",f5x2,5,2},{"f32 4x3",f4x3,4,3},{"f32 3x4",f3x4,3,4},{"f32 8x1",f8x1,8,1},{"f32 2x6",f2x6,2,6},{"bf16 4x2",b4x2,4,2},{"bf16 6x2",b6x2,6,2},{"bf16 4x3",b4x3,4,3},{"bf16 8x1",b8x1,8,1}};
  for(int round=0;round<2;round++) for(int i=0;i<11;i++){ int tok=argc>2?atoi(argv[2]):12; int reps=240000/tok; double t=now(); v[i].f(reps,tok); double dt=now()-t;
    double macs=(double)reps*(tok/v[i].T*v[i].T)*v[i].R*1024; printf("%-10s %.1f GMAC/s\n", v[i].n, macs/dt/1e9);}
  printf("%f\n",sink);
}
