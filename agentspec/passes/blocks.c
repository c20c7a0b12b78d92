/* Products on a GGUF file's own weight blocks, and the decoder layers around them, for agentspec's
   target pass (blocks.py, products.py).

   y[r, n] = sum_k x[r, k] * w[n, k] for float32 rows x, with w read from its blocks of 32 weights:
     Q4_1: w = d * q + m, q a 4-bit code (16 bytes per block; byte j holds codes j and j + 16)
     Q8_0: w = d * q, q a signed byte (32 bytes per block)
     Q8_16: w = d * q as Q8_0, with a scale d per 16 weights (two per block)
     Q8_1: w = d * q + m, q an unsigned byte (32 bytes per block)
   d and m are the blocks' scales and minimums as float32. Each w is rounded exactly as the GGUF
   reader dequantises it (a product, then a sum; -ffp-contract=off keeps them apart), so these are
   the loaded model's float32 weights, read in a fifth (Q4_1) or a quarter (Q8_0) of the bytes. The
   file's other types are read into these exactly (layouts.py): Q4_0 and Q5_0 as Q8_0, Q4_K as Q4_1
   (its per-32 scale and minimum, products of the super-block's), Q6_K as Q8_16, Q5_1 and Q5_K as Q8_1.

   One source, built once per instruction-set level (levels.py: LEVELS). The level is two macros:
   AGENTSPEC_WIDTH (512: AVX-512; 256: AVX2 + FMA + F16C) and AGENTSPEC_VNNI (1: the integer products
   take vpdpbusd; 0: vpmaddwd). Everything above the primitives below is written once for all levels,
   and every level computes the same bits: float arithmetic runs on 16 logical lanes (one zmm, or two
   ymm taking the same operations lane by lane) with horizontal sums in one fixed tree, and the integer
   products are exact. So a pass gives the same logits on an AVX2 laptop as on an AVX-512 server, and
   each level is checked against the others on any machine that runs them (tests/test_blocks.py).

   Row-invariant by construction: each (row, output) pair takes the same operations in the same order
   however many rows and outputs are computed beside it and whichever thread computes it. So a row's
   result does not depend on how many positions or sequences share its pass. */

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif
#endif
#include <math.h>
/* OpenMP (-fopenmp) shares the laying out of a file's blocks among threads; built without it (Apple's
   clang), its pragmas are ignored and that runs on one thread. A pass's threads are the kernels' own
   (run_threads). */
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "blocks.h"
#if AGENTSPEC_AMX && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if !defined(AGENTSPEC_WIDTH) || !defined(AGENTSPEC_VNNI)
#error "build with -DAGENTSPEC_WIDTH=512|256|128 -DAGENTSPEC_VNNI=0|1 (levels.py: LEVELS)"
#endif
#if AGENTSPEC_WIDTH == 512 && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__))
#error "AGENTSPEC_WIDTH=512 needs AVX512F, BW, DQ and VL (-march=x86-64-v4)"
#endif
#if AGENTSPEC_WIDTH == 256 && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "AGENTSPEC_WIDTH=256 needs AVX2, FMA and F16C (-march=x86-64-v3)"
#endif
#if AGENTSPEC_WIDTH == 128 && !(defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD) && AGENTSPEC_VNNI)
#error "AGENTSPEC_WIDTH=128 is ARM NEON with the dot product (-march=armv8.2-a+dotprod, AGENTSPEC_VNNI=1)"
#endif
#if AGENTSPEC_VNNI && AGENTSPEC_WIDTH != 128 && !(defined(__AVX512VNNI__) || defined(__AVXVNNI__))
#error "AGENTSPEC_VNNI=1 needs AVX512-VNNI or AVX-VNNI"
#endif
#ifndef AGENTSPEC_AMX
#define AGENTSPEC_AMX 0
#endif
#if AGENTSPEC_AMX && !(AGENTSPEC_WIDTH == 512 && AGENTSPEC_VNNI && (defined(__AMX_TILE__) || defined(__AMXTILE__)) && (defined(__AMX_INT8__) || defined(__AMXINT8__))) /* GCC's names, clang's */
#error "AGENTSPEC_AMX=1 is AVX512-VNNI with AMX-INT8 tiles (-mavx512vnni -mamx-tile -mamx-int8)"
#endif

#define UNROLL _Pragma("GCC unroll 16")
#define PREFETCH(p) __builtin_prefetch((p), 0, 3) /* for reading, into every cache level */
#define INLINE static inline __attribute__((always_inline))

/* ==== Primitives, per level =======================================================================
   v16: 16 float lanes. vf, vi: the level's native register of LANES floats, LANES 32-bit integers. */

#if defined(__x86_64__)
/* 8 lanes' sum by a fixed tree: the 128-bit halves, then (0 + 2) + (1 + 3) */
INLINE float sum8(__m256 t) {
    const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 v = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_shuffle_ps(v, v, 1));
}
/* vpshufb's indices of each 32-bit lane's bytes 0, 1 (upper: 2, 3), each followed by a zero byte */
INLINE __m128i byte_pairs(int upper) {
    const int k = upper ? 2 : 0;
    return _mm_setr_epi8(k, -1, k + 1, -1, 4 + k, -1, 5 + k, -1, 8 + k, -1, 9 + k, -1, 12 + k, -1, 13 + k, -1);
}
#endif

#if AGENTSPEC_WIDTH == 512
#define LANES 16
typedef __m512 v16;
typedef __m512 vf;
typedef __m512i vi;

INLINE v16 v16_zero(void) { return _mm512_setzero_ps(); }
INLINE v16 v16_set1(float a) { return _mm512_set1_ps(a); }
INLINE v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void v16_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
INLINE v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
INLINE v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
INLINE v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
INLINE v16 v16_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
INLINE v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
INLINE v16 v16_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
INLINE v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }  /* a * b + c, rounded once */
INLINE v16 v16_fnmadd(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b, rounded once */
INLINE v16 v16_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
INLINE v16 v16_scale2(v16 p, v16 n) { return _mm512_scalef_ps(p, n); } /* p * 2^n, n integral in [-126, 128] */
/* 16 lanes holding integers of [-128, 127] ([-32768, 32767]) stored as bytes (16-bit integers) */
INLINE void v16_store_i8(int8_t out[16], v16 a) { _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a))); }
INLINE void v16_store_i16(int16_t out[16], v16 a) { _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(a))); }
INLINE float v16_top(v16 a) { return _mm512_reduce_max_ps(a); }
/* 16 float16 values, converted exactly; rounded to nearest-even the other way (as torch rounds) */
INLINE v16 v16_load_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE void v16_store_half(uint16_t *p, v16 a) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
/* 16 bytes, zero- (sign-) extended */
INLINE v16 v16_from_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE v16 v16_from_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* the first n (< 16) lanes from p, the rest `fill`; the first n lanes to p; lanes from n on zeroed */
INLINE __mmask16 first(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
INLINE v16 v16_load_first(const float *p, int n, float fill) { return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), first(n), p); }
INLINE void v16_store_first(float *p, v16 a, int n) { _mm512_mask_storeu_ps(p, first(n), a); }
INLINE v16 v16_keep_first(v16 a, int n) { return _mm512_maskz_mov_ps(first(n), a); }
/* The sum of the lanes: the two 256-bit halves, then as sum8 */
INLINE float v16_sum(v16 a) { return sum8(_mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_castps512_ps256(a))); }
/* Q4_1 weights d * q + m of 16 bytes of codes (low nibbles: weights 0..15, high: 16..31) through a
   table of the block's 16 possible weights (vpermps reads an index's low 4 bits): the same bits as
   the product and sum per weight. */
INLINE void q4_1_weights(const uint8_t *codes, float d, float m, v16 *low, v16 *high) {
    const __m512 table = _mm512_add_ps(_mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(d)), _mm512_set1_ps(m));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    *low = _mm512_permutexvar_ps(q, table);
    *high = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
}
/* Lane j of the result: the sum of a[j]'s lanes by one fixed tree (within 128-bit lanes (0 + 2) +
   (1 + 3), then across them (L0 + L1) + (L2 + L3)), wherever a[j] sits among the 16. */
INLINE v16 v16_sums(const v16 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* native registers (here the same 16 lanes) */
INLINE vf vf_zero(void) { return _mm512_setzero_ps(); }
INLINE vf vf_set1(float a) { return _mm512_set1_ps(a); }
INLINE vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vf_from_vi(vi a) { return _mm512_cvtepi32_ps(a); }
INLINE vf vf_load_half(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vf vf_from_i8(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); } /* LANES signed bytes */
INLINE void vf_store_first(float *p, vf a, int n) { _mm512_mask_storeu_ps(p, first(n), a); }
INLINE vi vi_zero(void) { return _mm512_setzero_si512(); }
INLINE vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
INLINE void vi_store(void *p, vi a) { _mm512_storeu_si512(p, a); }
INLINE vi vi_set1(int32_t a) { return _mm512_set1_epi32(a); }
INLINE vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
INLINE vi vi_shl(vi a, int n) { return _mm512_slli_epi32(a, n); }
INLINE vi vi_shr(vi a, int n) { return _mm512_srli_epi32(a, n); } /* logical */
INLINE vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vi vi_and16(vi a, int16_t mask) { return _mm512_and_si512(a, _mm512_set1_epi16(mask)); }
INLINE vi vi_shr16(vi a, int n) { return _mm512_srli_epi16(a, n); } /* each 16-bit half, logical */
INLINE vi vi_madd16(vi a, vi b) { return _mm512_madd_epi16(a, b); }  /* lane: a.lo16 * b.lo16 + a.hi16 * b.hi16, exact */
/* a, kept in a register as computed: GCC may not reassociate the sums around it (exact either way,
   but reassociated, the unrolled sums of 8 rows became trees of spilled registers) */
INLINE vi vi_keep(vi a) { __asm__("" : "+v"(a)); return a; }
/* each lane's bytes 0, 1 (upper: 2, 3) as its two 16-bit halves, zero-extended */
INLINE vi vi_bytes16(vi a, int upper) { return _mm512_shuffle_epi8(a, _mm512_broadcast_i32x4(byte_pairs(upper))); }
#if AGENTSPEC_VNNI
INLINE vi vi_dot4(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); } /* lane: acc + 4 unsigned x signed bytes, exact */
#endif

#elif AGENTSPEC_WIDTH == 256 /* two ymm for 16 lanes, lanes 0..7 and 8..15, each taking the zmm's operations */
#define LANES 8
typedef struct { __m256 lo, hi; } v16;
typedef __m256 vf;
typedef __m256i vi;

INLINE v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
INLINE v16 v16_set1(float a) { return (v16){_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
INLINE v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
INLINE void v16_store(float *p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
INLINE v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
INLINE v16 v16_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
INLINE v16 v16_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
INLINE v16 v16_div(v16 a, v16 b) { return (v16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
INLINE v16 v16_max(v16 a, v16 b) { return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
INLINE v16 v16_min(v16 a, v16 b) { return (v16){_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
INLINE v16 v16_fmadd(v16 a, v16 b, v16 c) { return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
INLINE v16 v16_fnmadd(v16 a, v16 b, v16 c) { return (v16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
INLINE v16 v16_round(v16 a) {
    return (v16){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
/* p * 2^n as vscalefps computes it, for n integral in [-126, 128]: two exact powers of two (halves of
   n, each within [-63, 64]), so the product is rounded once, as vscalefps rounds it. */
INLINE __m256 pow2(__m256i k) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23)); }
INLINE __m256 scale2(__m256 p, __m256 n) {
    const __m256i k = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(k, 1);
    return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(k, half)));
}
INLINE v16 v16_scale2(v16 p, v16 n) { return (v16){scale2(p.lo, n.lo), scale2(p.hi, n.hi)}; }
/* the 16 lanes as 16-bit integers in lane order (vpackssdw interleaves the 128-bit halves: put back) */
INLINE __m256i to_i16(v16 a) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)), _MM_SHUFFLE(3, 1, 2, 0)); }
INLINE void v16_store_i16(int16_t out[16], v16 a) { _mm256_storeu_si256((__m256i *)out, to_i16(a)); }
INLINE void v16_store_i8(int8_t out[16], v16 a) {
    const __m256i w = to_i16(a);
    _mm_storeu_si128((__m128i *)out, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
INLINE float v16_top(v16 a) {
    const __m256 t = _mm256_max_ps(a.lo, a.hi);
    const __m128 u = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    const __m128 v = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ss(v, _mm_shuffle_ps(v, v, 1)));
}
INLINE v16 v16_load_half(const uint16_t *p) {
    return (v16){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
INLINE void v16_store_half(uint16_t *p, v16 a) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(p + 8), _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
INLINE v16 v16_from_u8(const uint8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)))};
}
INLINE v16 v16_from_i8(const int8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return (v16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
/* lanes below n: all ones */
INLINE __m256i below(int n, int from) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - from), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
INLINE v16 v16_load_first(const float *p, int n, float fill) {
    const __m256i lo = below(n, 0), hi = below(n, 8);
    return (v16){_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, lo), _mm256_castsi256_ps(lo)),
                 _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p + 8, hi), _mm256_castsi256_ps(hi))};
}
INLINE void v16_store_first(float *p, v16 a, int n) { _mm256_maskstore_ps(p, below(n, 0), a.lo); _mm256_maskstore_ps(p + 8, below(n, 8), a.hi); }
INLINE v16 v16_keep_first(v16 a, int n) {
    return (v16){_mm256_and_ps(a.lo, _mm256_castsi256_ps(below(n, 0))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(below(n, 8)))};
}
/* The zmm's tree: the halves (lanes 0..7 + 8..15), then as sum8 */
INLINE float v16_sum(v16 a) { return sum8(_mm256_add_ps(a.hi, a.lo)); }
INLINE void q4_1_weights(const uint8_t *codes, float d, float m, v16 *low, v16 *high) {
    const __m128i q = _mm_loadu_si128((const __m128i *)codes), nibble = _mm_set1_epi8(15);
    const v16 dd = v16_set1(d), mm = v16_set1(m);
    uint8_t split[32];
    _mm_storeu_si128((__m128i *)split, _mm_and_si128(q, nibble));
    _mm_storeu_si128((__m128i *)(split + 16), _mm_and_si128(_mm_srli_epi16(q, 4), nibble));
    *low = v16_add(v16_mul(v16_from_u8(split), dd), mm);
    *high = v16_add(v16_mul(v16_from_u8(split + 16), dd), mm);
}
/* The zmm's tree (above), on 128-bit lanes L0, L1 (lo) and L2, L3 (hi). */
INLINE v16 v16_sums(const v16 a[16]) {
    v16 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = (v16){_mm256_add_ps(_mm256_unpacklo_ps(a[2 * i].lo, a[2 * i + 1].lo), _mm256_unpackhi_ps(a[2 * i].lo, a[2 * i + 1].lo)),
                     _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i].hi, a[2 * i + 1].hi), _mm256_unpackhi_ps(a[2 * i].hi, a[2 * i + 1].hi))};
    for (int i = 0; i < 4; i++)
        c[i] = (v16){_mm256_add_ps(_mm256_shuffle_ps(b[2 * i].lo, b[2 * i + 1].lo, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(b[2 * i].lo, b[2 * i + 1].lo, _MM_SHUFFLE(3, 2, 3, 2))),
                     _mm256_add_ps(_mm256_shuffle_ps(b[2 * i].hi, b[2 * i + 1].hi, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(b[2 * i].hi, b[2 * i + 1].hi, _MM_SHUFFLE(3, 2, 3, 2)))};
    __m256 out[2];
    for (int i = 0; i < 2; i++) { /* (c.L0 + c.L1) + (c.L2 + c.L3) for c[2i] (low 128 bits) and c[2i + 1] (high) */
        const v16 x = c[2 * i], y = c[2 * i + 1];
        const __m256 pairs01 = _mm256_add_ps(_mm256_permute2f128_ps(x.lo, y.lo, 0x20), _mm256_permute2f128_ps(x.lo, y.lo, 0x31));
        const __m256 pairs23 = _mm256_add_ps(_mm256_permute2f128_ps(x.hi, y.hi, 0x20), _mm256_permute2f128_ps(x.hi, y.hi, 0x31));
        out[i] = _mm256_add_ps(pairs01, pairs23);
    }
    return (v16){out[0], out[1]};
}

INLINE vf vf_zero(void) { return _mm256_setzero_ps(); }
INLINE vf vf_set1(float a) { return _mm256_set1_ps(a); }
INLINE vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vf_from_vi(vi a) { return _mm256_cvtepi32_ps(a); }
INLINE vf vf_load_half(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vf vf_from_i8(const void *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE void vf_store_first(float *p, vf a, int n) { _mm256_maskstore_ps(p, below(n, 0), a); }
INLINE vi vi_zero(void) { return _mm256_setzero_si256(); }
INLINE vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vi vi_set1(int32_t a) { return _mm256_set1_epi32(a); }
INLINE vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
INLINE vi vi_shl(vi a, int n) { return _mm256_slli_epi32(a, n); }
INLINE vi vi_shr(vi a, int n) { return _mm256_srli_epi32(a, n); }
INLINE vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
INLINE vi vi_and16(vi a, int16_t mask) { return _mm256_and_si256(a, _mm256_set1_epi16(mask)); }
INLINE vi vi_shr16(vi a, int n) { return _mm256_srli_epi16(a, n); }
INLINE vi vi_madd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
INLINE vi vi_keep(vi a) { __asm__("" : "+x"(a)); return a; }
INLINE vi vi_bytes16(vi a, int upper) { return _mm256_shuffle_epi8(a, _mm256_broadcastsi128_si256(byte_pairs(upper))); }
#if AGENTSPEC_VNNI
#if defined(__AVXVNNI__) && !defined(__AVX512VNNI__)
INLINE vi vi_dot4(vi acc, vi u, vi s) { return _mm256_dpbusd_avx_epi32(acc, u, s); } /* AVX-VNNI (VEX) */
#else
INLINE vi vi_dot4(vi acc, vi u, vi s) { return _mm256_dpbusd_epi32(acc, u, s); } /* the same instruction, EVEX (AVX512-VNNI + VL) */
#endif
#endif
#else /* AGENTSPEC_WIDTH == 128: ARM NEON, four q registers for 16 lanes (the zmm's 128-bit lanes), each taking its operations */
#define LANES 4
#define SIGNED_DOT 1 /* sdot multiplies signed by signed bytes: Q8_0's codes are used as the file stores them */
typedef struct { float32x4_t q[4]; } v16;
typedef float32x4_t vf;
typedef int32x4_t vi;

INLINE v16 v16_zero(void) { return (v16){{vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}}; }
INLINE v16 v16_set1(float a) { return (v16){{vdupq_n_f32(a), vdupq_n_f32(a), vdupq_n_f32(a), vdupq_n_f32(a)}}; }
INLINE v16 v16_load(const float *p) { return (v16){{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
INLINE void v16_store(float *p, v16 a) { for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, a.q[i]); }
#define V16_BINARY(NAME, OP) INLINE v16 NAME(v16 a, v16 b) { v16 c; for (int i = 0; i < 4; i++) c.q[i] = OP(a.q[i], b.q[i]); return c; }
V16_BINARY(v16_add, vaddq_f32)
V16_BINARY(v16_sub, vsubq_f32)
V16_BINARY(v16_mul, vmulq_f32)
V16_BINARY(v16_div, vdivq_f32)
V16_BINARY(v16_max, vmaxq_f32)
V16_BINARY(v16_min, vminq_f32)
INLINE v16 v16_fmadd(v16 a, v16 b, v16 c) { for (int i = 0; i < 4; i++) c.q[i] = vfmaq_f32(c.q[i], a.q[i], b.q[i]); return c; }
INLINE v16 v16_fnmadd(v16 a, v16 b, v16 c) { for (int i = 0; i < 4; i++) c.q[i] = vfmsq_f32(c.q[i], a.q[i], b.q[i]); return c; }
INLINE v16 v16_round(v16 a) { for (int i = 0; i < 4; i++) a.q[i] = vrndnq_f32(a.q[i]); return a; }
/* p * 2^n as vscalefps computes it, for n integral in [-126, 128] (as the AVX2 level: two exact powers of two) */
INLINE float32x4_t pow2(int32x4_t k) { return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k, vdupq_n_s32(127)), 23)); }
INLINE v16 v16_scale2(v16 p, v16 n) {
    for (int i = 0; i < 4; i++) {
        const int32x4_t k = vcvtnq_s32_f32(n.q[i]), half = vshrq_n_s32(k, 1);
        p.q[i] = vmulq_f32(vmulq_f32(p.q[i], pow2(half)), pow2(vsubq_s32(k, half)));
    }
    return p;
}
INLINE void v16_store_i8(int8_t out[16], v16 a) {
    int16x4_t w[4];
    for (int i = 0; i < 4; i++) w[i] = vmovn_s32(vcvtnq_s32_f32(a.q[i]));
    vst1q_s8(out, vcombine_s8(vmovn_s16(vcombine_s16(w[0], w[1])), vmovn_s16(vcombine_s16(w[2], w[3]))));
}
INLINE float v16_top(v16 a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3]))); }
INLINE v16 v16_load_half(const uint16_t *p) {
    v16 a;
    for (int i = 0; i < 4; i++) a.q[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
    return a;
}
INLINE void v16_store_half(uint16_t *p, v16 a) { for (int i = 0; i < 4; i++) vst1_u16(p + 4 * i, vreinterpret_u16_f16(vcvt_f16_f32(a.q[i]))); }
INLINE v16 v16_widen(uint16x8_t lo, uint16x8_t hi) {
    return (v16){{vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))), vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
                  vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)))}};
}
INLINE v16 v16_from_u8(const uint8_t *p) { const uint8x16_t q = vld1q_u8(p); return v16_widen(vmovl_u8(vget_low_u8(q)), vmovl_u8(vget_high_u8(q))); }
INLINE v16 v16_from_i8(const int8_t *p) {
    const int8x16_t q = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(q)), hi = vmovl_s8(vget_high_s8(q));
    return (v16){{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                  vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}
INLINE v16 v16_load_first(const float *p, int n, float fill) {
    float lanes[16];
    for (int i = 0; i < 16; i++) lanes[i] = i < n ? p[i] : fill;
    return v16_load(lanes);
}
INLINE void v16_store_first(float *p, v16 a, int n) {
    float lanes[16];
    v16_store(lanes, a);
    memcpy(p, lanes, sizeof(float) * (n < 16 ? n : 16));
}
INLINE v16 v16_keep_first(v16 a, int n) {
    for (int i = 0; i < 4; i++) {
        const uint32x4_t index = vaddq_u32(vdupq_n_u32(4 * i), (uint32x4_t){0, 1, 2, 3});
        a.q[i] = vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(a.q[i]), vcltq_u32(index, vdupq_n_u32((uint32_t)n))));
    }
    return a;
}
/* The zmm's tree: (L0 + L2, L1 + L3), then their sum, then (0 + 2) + (1 + 3). */
INLINE float v16_sum(v16 a) {
    const float32x4_t u = vaddq_f32(vaddq_f32(a.q[3], a.q[1]), vaddq_f32(a.q[2], a.q[0]));
    const float32x4_t v = vaddq_f32(u, vextq_f32(u, u, 2));
    return vgetq_lane_f32(v, 0) + vgetq_lane_f32(v, 1);
}
INLINE void q4_1_weights(const uint8_t *codes, float d, float m, v16 *low, v16 *high) {
    const uint8x16_t q = vld1q_u8(codes), lo = vandq_u8(q, vdupq_n_u8(15)), hi = vshrq_n_u8(q, 4);
    const v16 dd = v16_set1(d), mm = v16_set1(m);
    *low = v16_add(v16_mul(v16_widen(vmovl_u8(vget_low_u8(lo)), vmovl_u8(vget_high_u8(lo))), dd), mm);
    *high = v16_add(v16_mul(v16_widen(vmovl_u8(vget_low_u8(hi)), vmovl_u8(vget_high_u8(hi))), dd), mm);
}
/* The zmm's tree: within 128-bit lanes (0 + 2) + (1 + 3), then across them (L0 + L1) + (L2 + L3). */
INLINE v16 v16_sums(const v16 a[16]) {
    v16 b[8], c[4], out;
    for (int i = 0; i < 8; i++)
        for (int l = 0; l < 4; l++) b[i].q[l] = vaddq_f32(vzip1q_f32(a[2 * i].q[l], a[2 * i + 1].q[l]), vzip2q_f32(a[2 * i].q[l], a[2 * i + 1].q[l]));
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 4; l++)
            c[i].q[l] = vaddq_f32(vcombine_f32(vget_low_f32(b[2 * i].q[l]), vget_low_f32(b[2 * i + 1].q[l])),
                                  vcombine_f32(vget_high_f32(b[2 * i].q[l]), vget_high_f32(b[2 * i + 1].q[l])));
    for (int i = 0; i < 4; i++) out.q[i] = vaddq_f32(vaddq_f32(c[i].q[0], c[i].q[1]), vaddq_f32(c[i].q[2], c[i].q[3]));
    return out;
}

INLINE vf vf_zero(void) { return vdupq_n_f32(0.0f); }
INLINE vf vf_set1(float a) { return vdupq_n_f32(a); }
INLINE vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
INLINE vf vf_fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
INLINE vf vf_from_vi(vi a) { return vcvtq_f32_s32(a); }
INLINE vf vf_load_half(const void *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }
INLINE vf vf_from_i8(const void *p) {
    int32_t word;
    memcpy(&word, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(word))))));
}
INLINE void vf_store_first(float *p, vf a, int n) {
    float lanes[4];
    vst1q_f32(lanes, a);
    memcpy(p, lanes, sizeof(float) * (n < 4 ? n : 4));
}
INLINE vi vi_zero(void) { return vdupq_n_s32(0); }
INLINE vi vi_load(const void *p) { return vld1q_s32((const int32_t *)p); }
INLINE vi vi_set1(int32_t a) { return vdupq_n_s32(a); }
INLINE vi vi_add(vi a, vi b) { return vaddq_s32(a, b); }
INLINE vi vi_sub(vi a, vi b) { return vsubq_s32(a, b); }
INLINE vi vi_shl(vi a, int n) { return vshlq_s32(a, vdupq_n_s32(n)); }
INLINE vi vi_shr(vi a, int n) { return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-n))); }
INLINE vi vi_or(vi a, vi b) { return vorrq_s32(a, b); }
INLINE vi vi_and16(vi a, int16_t mask) { return vreinterpretq_s32_s16(vandq_s16(vreinterpretq_s16_s32(a), vdupq_n_s16(mask))); }
INLINE vi vi_shr16(vi a, int n) { return vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a), vdupq_n_s16((int16_t)-n))); }
INLINE vi vi_flip_bytes(vi a) { return vreinterpretq_s32_u8(veorq_u8(vreinterpretq_u8_s32(a), vdupq_n_u8(0x80))); } /* code + 128 -> code */
INLINE vi vi_dot4(vi acc, vi u, vi s) { return vdotq_s32(acc, vreinterpretq_s8_s32(u), vreinterpretq_s8_s32(s)); } /* lane: acc + 4 signed x signed bytes, exact */
#endif
#ifndef SIGNED_DOT
#define SIGNED_DOT 0 /* vpdpbusd: unsigned codes (Q8_0's + 128) by signed activations */
#endif

INLINE v16 v16_abs(v16 a) { return v16_max(a, v16_sub(v16_zero(), a)); }

/* Whether this CPU runs what this library was built for (compiled for any CPU of its architecture, so
   safe to call). Call it before any product: on the AMX level it also asks Linux for the tiles.
   Features come from the CPU itself (cpuid, and xgetbv for what the system saves on a context switch)
   or the system (getauxval on Linux, sysctlbyname on macOS): no compiler built-ins, so GCC 11 and
   clang 14 build it. */
#if defined(__aarch64__) && defined(__linux__)
int agentspec_cpu_runs_this(void) { return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0; }
#elif defined(__aarch64__) && defined(__APPLE__)
int agentspec_cpu_runs_this(void) {
    int found = 0;
    size_t size = sizeof found;
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &found, &size, NULL, 0) == 0 && found != 0;
}
#elif defined(__aarch64__)
int agentspec_cpu_runs_this(void) { return 0; } /* how another system says so is not known here */
#else
#define BIT(n) (1u << (n))
#define HAS(word, bits) (((word) & (bits)) == (bits))
__attribute__((target("arch=x86-64"))) static uint64_t cpu_saved_state(void) {
    uint32_t low, high; /* XCR0: the register state the system saves, so may be used */
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    return ((uint64_t)high << 32) | low;
}

__attribute__((target("arch=x86-64"))) int agentspec_cpu_runs_this(void) {
    unsigned a1, b1, c1, d1, a7, b7, c7, d7, a71 = 0, b71, c71, d71, ae, be, ce, de;
    if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return 0;
    if (a7 >= 1) __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
    if (!__get_cpuid(0x80000001u, &ae, &be, &ce, &de)) ce = 0;
    /* x86-64-v3: AVX, AVX2, FMA, F16C, BMI1/2, MOVBE, LZCNT (and v2's SSE4.2, POPCNT), with the
       system saving the SSE and AVX registers (XCR0 bits 1, 2) */
    int ok = HAS(c1, BIT(0) | BIT(9) | BIT(12) | BIT(13) | BIT(19) | BIT(20) | BIT(22) | BIT(23) | BIT(27) | BIT(28) | BIT(29)) &&
             HAS(b7, BIT(3) | BIT(5) | BIT(8)) && HAS(ce, BIT(0) | BIT(5));
    uint64_t saved = ok ? cpu_saved_state() : 0;
    ok = ok && HAS(saved, 0x6u);
#if AGENTSPEC_WIDTH == 512
    /* x86-64-v4: AVX512 F, DQ, CD, BW, VL, with the opmask and upper zmm state saved (bits 5-7) */
    ok = ok && HAS(b7, BIT(16) | BIT(17) | BIT(28) | BIT(30) | BIT(31)) && HAS(saved, 0xE0u);
#endif
#ifdef __AVX512VNNI__
    ok = ok && HAS(c7, BIT(11)) && HAS(b7, BIT(31)) && HAS(saved, 0xE0u); /* AVX512-VNNI, AVX512VL */
#endif
#ifdef __AVXVNNI__
    ok = ok && HAS(a71, BIT(4)); /* AVX-VNNI */
#endif
#if AGENTSPEC_AMX && defined(__linux__)
    /* AMX-TILE and AMX-INT8; Linux lets a process use the tiles once it asks (5.16 and later), each
       thread's 8 KB of tile state allocated at its first use */
    ok = ok && HAS(d7, BIT(24) | BIT(25)) && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#elif AGENTSPEC_AMX
    ok = 0; /* how another system grants the tiles is not known here */
#endif
    return ok != 0;
}
#undef HAS
#undef BIT
#endif

const int agentspec_lanes = LANES; /* outputs per group in the layout of the integer products (Blocks.by_lanes) */

/* ==== Working memory ==============================================================================
   Every buffer is taken before the work it serves starts, outside any parallel region; a request that
   fails makes the call free what it took and return AGENTSPEC_NO_MEMORY (blocks.h) with nothing done,
   its size kept for agentspec_failed_bytes. Sizes are products of the caller's counts, saturated
   rather than wrapped, so a count too large for memory is a failed request, never a small buffer. */

static _Thread_local size_t failed_bytes; /* the calling thread's last request that failed */

size_t agentspec_failed_bytes(void) { return failed_bytes; }

/* a * b, or SIZE_MAX where it does not fit */
static size_t times(size_t a, size_t b) { return b && a > SIZE_MAX / b ? SIZE_MAX : a * b; }

/* malloc(bytes) (at least one byte: a NULL is a failure), the size kept where it fails */
static void *take(size_t bytes) {
    void *p = bytes == SIZE_MAX ? NULL : malloc(bytes ? bytes : 1);
    if (!p) failed_bytes = bytes;
    return p;
}

/* EACH(ARGS..., n) for n = count (1..8; more: 8) as a compile-time constant, so that the code EACH
   expands to unrolls its loops over n and keeps its per-n arrays in registers. */
#define BY_COUNT(count, EACH, ...)                                                                 \
    switch (count) {                                                                               \
    case 1: EACH(__VA_ARGS__, 1) break;                                                            \
    case 2: EACH(__VA_ARGS__, 2) break;                                                            \
    case 3: EACH(__VA_ARGS__, 3) break;                                                            \
    case 4: EACH(__VA_ARGS__, 4) break;                                                            \
    case 5: EACH(__VA_ARGS__, 5) break;                                                            \
    case 6: EACH(__VA_ARGS__, 6) break;                                                            \
    case 7: EACH(__VA_ARGS__, 7) break;                                                            \
    default: EACH(__VA_ARGS__, 8) break;                                                           \
    }
/* ==== Threads of a pass ===========================================================================
   The products and attention of a pass share their work among `threads` threads of the kernels' own:
   the caller and up to POOL_MAX - 1 workers, made on first use and kept. After a job a worker spins
   for the next one for up to SPIN_NS (the gaps between a pass's products are microseconds), then
   sleeps until woken. OpenMP's teams did this before, but libgomp spins only while the threads of
   every team in the process fit the CPUs: one parallel torch operation on any other thread (the
   application's, or a benchmark's) made it sleep and wake at each of a pass's ~170 joins, 1.5x
   slower on 2 cores (docs/kernels.md). A job shares n items statically (`share`: a thread's items
   depend only on n and the thread count, as OpenMP's schedule(static)); every (row, output) is
   computed by one thread in a fixed order, so the bits do not depend on the threads either. A call
   made while another thread's job holds the pool runs on its caller alone. */

#define POOL_MAX 256
#define SPIN_NS 300000 /* 0.3 ms */
typedef void (*job_fn)(void *job, int ith, int nth);

static struct {
    atomic_flag busy;                /* a caller's job holds the workers */
    atomic_uint generation;          /* counts jobs: a worker runs each one it sees */
    atomic_int pending;              /* workers that have not yet seen the current job through */
    atomic_int sleepers;             /* workers waiting on `wake` */
    job_fn fn;                       /* the current job, its argument, its thread count */
    void *job;
    int nth, workers;                /* workers made so far */
    unsigned made_at[POOL_MAX];      /* the generation when each worker was made */
    pthread_mutex_t lock;
    pthread_cond_t wake;
} pool = {ATOMIC_FLAG_INIT, 0, 0, 0, NULL, NULL, 1, 0, {0}, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* Items [lo, hi) of n for thread ith of nth: contiguous, sizes differing by at most one. */
INLINE void share(long n, int ith, int nth, long *lo, long *hi) {
    const long base = n / nth, extra = n % nth;
    *lo = ith * base + (ith < extra ? ith : extra);
    *hi = *lo + base + (ith < extra);
}

INLINE void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *pool_worker(void *arg) {
    const int ith = (int)(intptr_t)arg;
    unsigned seen = pool.made_at[ith]; /* the generation before the job it was made for */
    for (;;) {
        unsigned now = atomic_load(&pool.generation);
        const long long until = now_ns() + SPIN_NS;
        for (int spins = 0; now == seen; now = atomic_load(&pool.generation)) {
            if (++spins % 64) {
                cpu_relax();
                continue;
            }
            if (now_ns() < until) continue;
            pthread_mutex_lock(&pool.lock); /* idle: sleep (a caller that counts sleepers after its new generation wakes us) */
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = now;
        if (ith < pool.nth) pool.fn(pool.job, ith, pool.nth);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release); /* every worker, so none reads the next job's fields early */
    }
    return NULL;
}

/* A child forked while a job ran has no workers and a pool as the parent's threads left it. */
static void pool_after_fork(void) {
    atomic_flag_clear(&pool.busy);
    atomic_store(&pool.pending, 0), atomic_store(&pool.sleepers, 0);
    pool.workers = 0;
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
}
static void pool_once(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

/* fn(job, ith, nth) on nth = `threads` threads at most (fewer where no more workers could be made),
   the caller's ith 0; returns when every thread's share is done. */
static void run_threads(int threads, job_fn fn, void *job) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (threads <= 1 || atomic_flag_test_and_set(&pool.busy)) {
        fn(job, 0, 1);
        return;
    }
    pthread_once(&once, pool_once);
    while (pool.workers < threads - 1) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pool.made_at[pool.workers + 1] = atomic_load(&pool.generation); /* (only this caller moves it) */
        const int made = pthread_create(&thread, &attr, pool_worker, (void *)(intptr_t)(pool.workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!made) break;
        pool.workers++;
    }
    const int nth = threads < pool.workers + 1 ? threads : pool.workers + 1;
    pool.fn = fn, pool.job = job, pool.nth = nth;
    atomic_store(&pool.pending, pool.workers);
    atomic_fetch_add(&pool.generation, 1); /* publishes the job (sequentially consistent, as the sleepers' count below) */
    if (atomic_load(&pool.sleepers)) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    fn(job, 0, nth);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire)) cpu_relax();
    atomic_flag_clear(&pool.busy);
}

#define AHEAD 4 /* blocks prefetched ahead by products of 1-2 rows (bound by bytes, not arithmetic) */

/* ==== Products on float32 rows (weights="gguf") ===================================================
   Layout (Blocks.grouped in layouts.py): outputs in groups of G; for each group, its blocks in input
   order, each the G outputs' codes, then their G scales (and minimums): one stream of memory per
   group, read front to back and prefetched a few blocks ahead. (With codes, scales and minimums in
   three arrays, a 1-row product read three streams per output and reached about half the bandwidth.)
   Each (row, output) pair is one 16-lane accumulator taking two fused multiply-adds per block (lanes:
   weights 0..15, then 16..31), then one fixed horizontal sum (v16_sum). */

#define MR 8    /* rows per tile, at most */
#define MAXC 8  /* outputs per tile, at most */
#define FEW 8   /* outputs grouped together in the layout read by products of 1-2 rows */
#define MANY 4  /* ... and in the layout read by products of more rows */
#define Q4_1_BYTES(G) ((G) * (16 + 8)) /* one block of a group of G outputs: codes, scales, minimums */
#define Q8_0_BYTES(G) ((G) * (32 + 4)) /* codes, scales */
#define Q8_16_BYTES(G) ((G) * (32 + 8)) /* codes, two scales each */
#define Q8_1_BYTES(G) ((G) * (32 + 8))  /* codes, scales, minimums */

/* How many outputs a tile of `rows` rows takes: enough independent accumulators to hide the
   latency of the multiply-adds, few enough to stay in the vector registers (32 zmm; 16 ymm, two per
   v16). It does not change any (row, output) pair's arithmetic. */
#if AGENTSPEC_WIDTH == 512
INLINE int tile_outputs(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }
#else
INLINE int tile_outputs(int rows) { return rows <= 2 ? 2 : 1; }
#endif
INLINE int group_of(int rows) { return rows <= 2 ? FEW : MANY; }

/* One tile: outputs n .. n + nt - 1 for `rows` rows (compile-time constants at every call site, so
   the loops unroll and the accumulators live in registers), reading the layout grouped by G. The
   macro's argument dequantises the block at `at` (lane `lane` of its group) into w0[t] (weights
   0..15) and w1[t] (16..31). */
#define TILE_BODY(BYTES, ...)                                                                       \
    const int nb = K / 32, cols = tile_outputs(rows), G = group_of(rows);                          \
    v16 acc[MAXC][MR];                                                                             \
    UNROLL for (int t = 0; t < MAXC; t++) UNROLL for (int r = 0; r < MR; r++) acc[t][r] = v16_zero(); \
    for (int b = 0; b < nb; b++) {                                                                 \
        v16 w0[MAXC], w1[MAXC];                                                                    \
        UNROLL for (int t = 0; t < MAXC; t++) {                                                    \
            if (t < cols) {                                                                        \
                const int o = n + (t < nt ? t : 0), lane = o % G;                                  \
                const uint8_t *at = (G == FEW ? few : many) + ((size_t)(o / G) * nb + b) * (BYTES); \
                if (rows <= 2 && t == 0)                                                           \
                    for (int line = 0; line < (BYTES); line += 64) PREFETCH(at + AHEAD * (BYTES) + line); \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
        UNROLL for (int r = 0; r < MR; r++) {                                                      \
            if (r < rows) {                                                                        \
                const float *xr = x + (size_t)r * K + (size_t)b * 32;                              \
                const v16 x0 = v16_load(xr), x1 = v16_load(xr + 16);                               \
                UNROLL for (int t = 0; t < MAXC; t++) {                                            \
                    if (t < cols) {                                                                \
                        acc[t][r] = v16_fmadd(x0, w0[t], acc[t][r]);                               \
                        acc[t][r] = v16_fmadd(x1, w1[t], acc[t][r]);                               \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    UNROLL for (int t = 0; t < MAXC; t++) UNROLL for (int r = 0; r < MR; r++)                      \
        if (t < cols && t < nt && r < rows) y[(size_t)r * N + n + t] = v16_sum(acc[t][r]);

INLINE void q4_1_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many, float *y, int N, int n, int nt) {
    TILE_BODY(Q4_1_BYTES(G),
        q4_1_weights(at + lane * 16, ((const float *)(at + G * 16))[lane], ((const float *)(at + G * 20))[lane], &w0[t], &w1[t]);
    )
}

INLINE void q8_0_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many, float *y, int N, int n, int nt) {
    TILE_BODY(Q8_0_BYTES(G),
        const v16 scale = v16_set1(((const float *)(at + G * 32))[lane]);
        const int8_t *codes = (const int8_t *)(at + lane * 32);
        w0[t] = v16_mul(v16_from_i8(codes), scale);
        w1[t] = v16_mul(v16_from_i8(codes + 16), scale);
    )
}

INLINE void q8_16_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many, float *y, int N, int n, int nt) {
    TILE_BODY(Q8_16_BYTES(G),
        const float *scales = (const float *)(at + G * 32) + 2 * lane;
        const int8_t *codes = (const int8_t *)(at + lane * 32);
        w0[t] = v16_mul(v16_from_i8(codes), v16_set1(scales[0]));
        w1[t] = v16_mul(v16_from_i8(codes + 16), v16_set1(scales[1]));
    )
}

INLINE void q8_1_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many, float *y, int N, int n, int nt) {
    TILE_BODY(Q8_1_BYTES(G),
        const v16 d = v16_set1(((const float *)(at + G * 32))[lane]), m = v16_set1(((const float *)(at + G * 36))[lane]);
        const uint8_t *codes = at + lane * 32;
        w0[t] = v16_add(v16_mul(v16_from_u8(codes), d), m);
        w1[t] = v16_add(v16_mul(v16_from_u8(codes + 16), d), m);
    )
}

/* Rows in chunks of MR; a chunk's outputs in tiles shared among the threads (run_threads). */
typedef struct {
    const float *x;
    int K, N;
    const uint8_t *few, *many;
    float *y;
} tile_job;

/* TILE##_job_##ROWS: a thread's tiles of a chunk of ROWS rows */
#define TILE_JOB(TILE, ROWS)                                                                       \
    static void TILE##_job_##ROWS(void *job, int ith, int nth) {                                   \
        const tile_job *j = job;                                                                   \
        const int cols = tile_outputs(ROWS);                                                       \
        long lo, hi;                                                                               \
        share((j->N + cols - 1) / cols, ith, nth, &lo, &hi);                                       \
        for (long tile = lo; tile < hi; tile++) {                                                  \
            const int n = (int)tile * cols;                                                        \
            TILE(j->x, ROWS, j->K, j->few, j->many, j->y, j->N, n, j->N - n < cols ? j->N - n : cols); \
        }                                                                                          \
    }
#define TILE_JOBS(TILE) TILE_JOB(TILE, 1) TILE_JOB(TILE, 2) TILE_JOB(TILE, 3) TILE_JOB(TILE, 4) TILE_JOB(TILE, 5) TILE_JOB(TILE, 6) TILE_JOB(TILE, 7) TILE_JOB(TILE, 8)
TILE_JOBS(q4_1_tile)
TILE_JOBS(q8_0_tile)
TILE_JOBS(q8_16_tile)
TILE_JOBS(q8_1_tile)

#define CHUNK(TILE, ROWS)                                                                          \
    {                                                                                              \
        tile_job job = {xr, K, N, (const uint8_t *)few, (const uint8_t *)many, yr};               \
        run_threads(threads, TILE##_job_##ROWS, &job);                                             \
    }

#define PRODUCT(TILE)                                                                              \
    for (int r0 = 0; r0 < M; r0 += MR) {                                                           \
        const float *xr = x + (size_t)r0 * K;                                                      \
        float *yr = y + (size_t)r0 * N;                                                            \
        BY_COUNT(M - r0, CHUNK, TILE)                                                              \
    }

/* Whether a product's counts and pointers are ones the kernels read (no rows: nothing to read). */
static int product_arguments(const float *x, int M, int K, const void *w, const float *y, int N, int threads) {
    return M >= 0 && K > 0 && K % 32 == 0 && N > 0 && threads >= 1 && (M == 0 || (x && w && y));
}

#define CHECKED_PRODUCT(TILE)                                                                      \
    if (!product_arguments(x, M, K, few, y, N, threads) || (M && !many)) return AGENTSPEC_BAD_ARGUMENT; \
    PRODUCT(TILE)                                                                                  \
    return AGENTSPEC_OK;

/* few, many: the blocks grouped by FEW and by MANY outputs (Blocks.grouped in layouts.py). */
int agentspec_q4_1_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    CHECKED_PRODUCT(q4_1_tile)
}

int agentspec_q8_0_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    CHECKED_PRODUCT(q8_0_tile)
}

int agentspec_q8_16_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    CHECKED_PRODUCT(q8_16_tile)
}

int agentspec_q8_1_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    CHECKED_PRODUCT(q8_1_tile)
}

/* ==== Products on 8- and 16-bit activations (weights="gguf-q8", "gguf-q16") =======================
   llama.cpp's arithmetic for these blocks: each row is quantised per block of 32 inputs to integers a
   with one float scale (d_a = max|x| / 127, a = round(x / d_a); "q16": max|x| / 32639), and a block's
   product is an exact integer dot product of codes, scaled:
     with minimums (Q4_1, Q5_1, Q4_K, Q5_K): sum_k w x ~ d_w d_a sum(q a) + m_w (d_a sum(a))
     without (Q8_0, Q4_0, Q5_0):             sum_k w x ~ d_w d_a sum((q - offset) a)
     a scale per 16 (Q6_K):                  sum_k w x ~ d_a sum_h d_h sum_h((q - offset) a), h each half
   The weights are the file's, unchanged; only the activations are rounded (q8: to 1/254 of a block's
   largest magnitude; q16: 1/65278), so these are another model's products than the float32 kernels
   above: "gguf-q8" is asked for by name, "gguf-q16" is a candidate of "auto" (weights.py).

   The integer dot products, exact on every level (so every level gives the same bits):
   - VNNI (AVX512-VNNI, AVX-VNNI): vpdpbusd multiplies 4 unsigned code bytes by 4 signed activation
     bytes per lane. q16 rows are split exactly into two planes of bytes (a = 256 high + low), so a
     block takes two dot products per register.
   - otherwise (AVX2, AVX-512 without VNNI): vpmaddwd on 16-bit halves of the lanes, codes widened
     by a byte shuffle, activations kept as 16-bit integers (both q8 and q16: one plane).
   - AMX (level avx512-amx, 5 or more rows): vpdpbusd's products, a block's for every row at once in
     one tile multiply (below).
   Codes are unsigned: sum((q - offset) a) = sum(q a) - offset sum(a), exactly, in 32-bit integers.

   Layout (Blocks.by_lanes in layouts.py): outputs in groups of LANES, one 32-bit lane each; per group,
   its blocks in input order, each as many bytes a weight as the file's. A block's codes, one of four
   kinds (CODES_*):
   - bytes: 8 registers (register j, lane o: output o's codes 4j..4j+3), Q8_0's + 128 (offset 128);
   - 4-bit: 4 registers (register j, lane o: the byte holding codes 4j..4j+3 of output o in its low
     nibbles, 16+4j.. in its high ones, as the file packs them); Q4_0's codes offset by 8;
   - 5-bit: the 4-bit registers of the low bits, then one register of the fifth bits (lane o: bit
     8i + j is that of code 4j + i, so a shift puts codes 4j..4j+3's on bit 4 of their bytes); Q5_0's
     codes offset by 16;
   - 6-bit: the 5-bit registers, then one of the sixth bits, arranged as the fifth; Q6_K's offset by 32;
   then the LANES scales (and minimums) as float16, exactly the file's; with a scale per 16 weights
   ("halves", Q6_K's), the LANES scales of each half block in turn. "Factored" scales (the K-quants':
   a super-block's float16 scale times a 6- or 8-bit one, no float16 value) are kept as the file keeps
   them: each block's LANES factors as signed bytes (scales, each half's, then minimums), and before
   every super-block of 8 blocks the LANES float16 super-scales (d, then the minimums' -dmin). A
   scale is their product in float32, exact (11 bits times 8), so the file's value.

   Each (row, output) pair is one lane taking the same integer dot products and float multiply-adds
   in the same order (no horizontal sum), whatever else shares the call and whichever thread and level
   computes it. Q5_0's 5-bit codes and the same blocks as bytes (code - 16 + 128) give the same
   integer sums, so the same bits. */

enum { CODES_BYTES = 0, CODES_4BIT = 1, CODES_5BIT = 2, CODES_6BIT = 3 };
#define CODE_BYTES(codes) ((codes) == CODES_BYTES ? 32 : (codes) == CODES_4BIT ? 16 : (codes) == CODES_5BIT ? 20 : 24) /* a block's, per output */
/* a group's block: its codes, then its scales (two with halves) and minimums, float16 or ("factored")
   signed bytes; and the float16 super-scales before each super-block of factored blocks */
#define INT_BYTES(codes, mins, factored, halves) (LANES * CODE_BYTES(codes) + LANES * (1 + (mins) + (halves)) * ((factored) ? 1 : 2))
#define SUPER 8 /* blocks of a super-block */
#define SUPER_BYTES(mins) (LANES * 2 * (1 + (mins)))
/* what the codes are offset by (subtracted from their dot product) in blocks without minimums */
#define OFFSET(codes) ((codes) == CODES_BYTES ? (SIGNED_DOT ? 0 : 128) : 8 << ((codes) - CODES_4BIT))
#define REGISTER (LANES * 4)                                                       /* bytes of codes per register */
#define ROWS8 8                                                                    /* rows per tile, at most */
#if AGENTSPEC_VNNI
#define ROW_BYTES(planes) (32 * (planes)) /* a row's block: its planes of 32 signed bytes */
#else
#define ROW_BYTES(planes) 64 /* a row's block: its 32 activations as 16-bit integers */
#endif

/* Row r, block b (at b * M + r: a block's rows side by side, at offsets fixed at compile time): its
   codes at codes + (b * M + r) * ROW_BYTES; its scale d, d * sum(a), sum(a) and the sum of its first
   16 codes (for blocks with a scale per 16). */
typedef struct {
    uint8_t *codes;
    float *scale, *scaled_sum;
    int32_t *sum, *half;
    int M;
} agentspec_q8_rows;

/* One block of 32 inputs of a row: a = round(x * inverse) into the level's codes; returns sum(a). One
   plane: a = round(x / d), d = max|x| / 127. Two planes (VNNI): a = round(x / d), d = max|x| / 32639,
   as 256 * high + low with high = floor((a + 128) / 256) and low = a - 256 * high, both in
   [-128, 127]: a dot product with them is 256 * (the high plane's) + (the low plane's), exactly.
   Without VNNI the codes are a as 16-bit integers. *half: the sum of the first 16. All of it in
   float lanes, exactly: the a are integers of at most 2^15, their sums below 2^24, and high is
   a / 256 + 1 / 512 rounded to nearest (a multiple of 1/512 that is never a tie). */
INLINE int32_t quantise_block(const float *xb, float inverse, const int planes, uint8_t *codes, int32_t *half) {
    const v16 a0 = v16_round(v16_mul(v16_load(xb), v16_set1(inverse))), a1 = v16_round(v16_mul(v16_load(xb + 16), v16_set1(inverse)));
    *half = (int32_t)v16_sum(a0);
#if AGENTSPEC_VNNI
    if (planes == 1) {
        v16_store_i8((int8_t *)codes, a0);
        v16_store_i8((int8_t *)codes + 16, a1);
    } else {
        const v16 high0 = v16_round(v16_mul(v16_add(a0, v16_set1(0.5f)), v16_set1(1.0f / 256))),
                  high1 = v16_round(v16_mul(v16_add(a1, v16_set1(0.5f)), v16_set1(1.0f / 256)));
        v16_store_i8((int8_t *)codes, high0);
        v16_store_i8((int8_t *)codes + 16, high1);
        v16_store_i8((int8_t *)codes + 32, v16_fnmadd(high0, v16_set1(256.0f), a0));
        v16_store_i8((int8_t *)codes + 48, v16_fnmadd(high1, v16_set1(256.0f), a1));
    }
#else
    v16_store_i16((int16_t *)codes, a0);
    v16_store_i16((int16_t *)codes + 16, a1);
#endif
    return (int32_t)v16_sum(v16_add(a0, a1));
}

/* Block b of row r of x ([M, K]) quantised into q. */
INLINE void quantise_row_block(const float *x, int K, const int planes, agentspec_q8_rows *q, int r, int b) {
    const float top_code = planes == 1 ? 127.0f : 32639.0f;
    const float *xb = x + (size_t)r * K + (size_t)b * 32;
    const float top = v16_top(v16_max(v16_abs(v16_load(xb)), v16_abs(v16_load(xb + 16))));
    float d = top / top_code, inverse = top > 0.0f ? top_code / top : 0.0f;
    if (isinf(inverse)) d = 0.0f, inverse = 0.0f; /* max|x| below top_code / FLT_MAX (~1e-35): no scale reaches it, a block of zeros */
    const size_t at = (size_t)b * q->M + r;
    q->sum[at] = quantise_block(xb, inverse, planes, q->codes + at * ROW_BYTES(planes), q->half + at);
    q->scale[at] = d;
    q->scaled_sum[at] = d * (float)q->sum[at];
}

/* Bit 8i + j of each lane of `bits` moved to bit 8i + to, the lane's other bits cleared. */
INLINE vi bit_to(vi bits, int j, int to) {
    const vi moved = j < to ? vi_shl(bits, to - j) : j > to ? vi_shr(bits, j - to) : bits;
    return vi_and16(moved, (int16_t)(0x0101 << to));
}

/* The codes of register j (weights 4j..4j+3 of each lane's output), as 4 unsigned bytes a lane (in
   the file's 4-, 5- and 6-bit codes: 0..63, so also signed bytes); `fifth`, `sixth`: the registers
   of the 5- and 6-bit codes' upper bits (bit 8i + j of a lane: code 4j + i's). */
INLINE vi codes_of(const int codes, const uint8_t *at, vi fifth, vi sixth, int j) {
    if (codes == CODES_BYTES) {
        const vi raw = vi_load(at + REGISTER * j);
#if SIGNED_DOT
        return vi_flip_bytes(raw); /* code + 128 -> code: sdot takes signed bytes, no offset */
#else
        return raw;
#endif
    }
    const vi low = vi_and16(vi_shr16(vi_load(at + REGISTER * (j % 4)), j < 4 ? 0 : 4), 0x0F0F); /* low nibbles, then high ones */
    if (codes == CODES_4BIT) return low;
    const vi five = vi_or(low, bit_to(fifth, j, 4));
    return codes == CODES_5BIT ? five : vi_or(five, bit_to(sixth, j, 5));
}

/* AMX (Sapphire Rapids and later): a block's integer dot products for a chunk of rows in one
   instruction. tdpbsud multiplies a tile of up to 16 rows of signed bytes (here each row's planes in
   turn: a block's rows sit side by side, ROW_BYTES apart, so rows * planes rows 32 bytes apart) by a
   tile of unsigned bytes laid out as the registers above are (row j: register j's 4 codes a lane),
   giving every (row, plane) and output's dot product in 32-bit integers: exactly the sums vpdpbusd
   gives, so the same bits. Each block's sums are stored (the scales differ per block) and scaled as
   vpdpbusd's are. From AMX_ROWS rows on this is faster than vpdpbusd (docs/kernels.md); fewer rows,
   and blocks with a scale per half (two 16-input products: slower than vpdpbusd), keep vpdpbusd. */
#if AGENTSPEC_AMX
#define AMX_ROWS 5
#define USES_AMX(rows, halves) ((rows) >= AMX_ROWS && !(halves))
#define AMX_AHEAD 6 /* how many blocks ahead of the one being scaled its codes are unpacked */
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette, start, reserved[14];
    uint16_t columns[16]; /* bytes a row */
    uint8_t rows[16];
} amx_config;

/* The calling thread's tiles for `tile_rows` rows (a chunk's rows times their planes), in two sets
   that blocks take in turn (an instruction on a tile waits for the last one on it): tiles 0, 1 the dot
   products (tile_rows x LANES 32-bit integers); 2, 3 the rows' bytes; 4, 5 the codes. */
static void amx_configure(int tile_rows) {
    amx_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int set = 0; set < 2; set++) {
        config.rows[set] = (uint8_t)tile_rows, config.columns[set] = 4 * LANES;
        config.rows[2 + set] = (uint8_t)tile_rows, config.columns[2 + set] = 32;
        config.rows[4 + set] = 8, config.columns[4 + set] = 4 * LANES;
    }
    __asm__ volatile("" : : "m"(config)); /* every byte read (GCC's ldtilecfg names only the first 8) */
    _tile_loadconfig(&config);
}

#define AMX_DOTS(activations, registers, dots, DOTS, ROWS, CODES) /* the tiles' numbers: literals, as the instructions take them */ \
    do {                                                                                           \
        _tile_loadd(ROWS, activations, 32);                                                        \
        _tile_loadd(CODES, registers, REGISTER);                                                   \
        _tile_zero(DOTS);                                                                          \
        _tile_dpbsud(DOTS, ROWS, CODES);                                                           \
        _tile_stored(DOTS, dots, 4 * LANES);                                                       \
    } while (0)

/* Block b's dot products (its codes at `at`; unpacked to bytes at `unpacked`) into dots: (row,
   plane) i's at dots + i * LANES. */
INLINE void amx_block(const int codes, const int planes, const agentspec_q8_rows *q, const uint8_t *at, int b, const uint8_t *unpacked, int32_t *dots) {
    const uint8_t *activations = q->codes + (size_t)b * q->M * ROW_BYTES(planes), *registers = codes == CODES_BYTES ? at : unpacked;
    __asm__ volatile("" : : : "memory"); /* the unpacked codes stored first (the tile loads name no memory) */
    if (b % 2 == 0)
        AMX_DOTS(activations, registers, dots, 0, 2, 4);
    else
        AMX_DOTS(activations, registers, dots, 1, 3, 5);
}

/* The codes of the block at `at` as bytes, a register a row (tdpbsud's unsigned tile; bytes: the
   block itself). */
INLINE void amx_unpack(const int codes, const uint8_t *at, uint8_t *out) {
    if (codes == CODES_BYTES) return;
    const vi fifth = codes >= CODES_5BIT ? vi_load(at + 4 * REGISTER) : vi_zero();
    const vi sixth = codes == CODES_6BIT ? vi_load(at + 5 * REGISTER) : vi_zero();
    UNROLL for (int j = 0; j < 8; j++) vi_store(out + j * REGISTER, codes_of(codes, at, fifth, sixth, j));
}
#define AMX_RELEASE() _tile_release()
#else
#define USES_AMX(rows, halves) 0
#define AMX_AHEAD 0
#define amx_configure(rows) ((void)(rows))
#define AMX_RELEASE() ((void)0)
#endif

/* Block b of group g (`group` bytes a group, `chunk` a super-block of `per` blocks of `bytes` after
   its `head` bytes of super-scales), as int_tile addresses it. */
INLINE const uint8_t *int_block(const uint8_t *w, int g, size_t group, size_t chunk, int head, int per, int bytes, int b) {
    return w + (size_t)g * group + (size_t)(b / per) * chunk + head + (size_t)(b % per) * bytes;
}

/* One tile: the LANES outputs of group g for `rows` rows on activations in `planes` planes, blocks
   of `codes` with or without minimums, `factored` scales, a scale per block or per half ("halves": the
   dot products of registers 0..3 and 4..7 scaled apart), all compile-time constants at every call
   site. A dot product of a row, in 32-bit integers (|sum| < 2^29, so exact whatever the order): with
   VNNI two chains of vpdpbusd (one per plane, or halves of the registers) to hide its latency; with
   vpmaddwd one chain of additions (1 cycle each), so 8 rows' sums stay in 16 ymm registers; on AMX
   (USES_AMX) the same sums from the tiles (amx_block), issued a block ahead. */
INLINE void int_tile(const int codes, const int mins, const int factored, const int halves, const int planes, const agentspec_q8_rows *q, const int rows,
                     int K, const uint8_t *w, float *y, int N, int g) {
    const int nb = K / 32, bytes = INT_BYTES(codes, mins, factored, halves), scales = LANES * CODE_BYTES(codes), size = factored ? 1 : 2;
    const int offset = mins ? 0 : OFFSET(codes), spans = halves ? 2 : 1, span = 8 / spans; /* registers per scale */
    const int per = factored ? SUPER : 1, head = factored ? SUPER_BYTES(mins) : 0; /* blocks per super-block, its super-scales' bytes */
    const size_t chunk = (size_t)head + (size_t)per * bytes, group = (size_t)(nb + per - 1) / per * head + (size_t)nb * bytes; /* a super-block's, a group's bytes */
    vf acc[ROWS8];
    UNROLL for (int r = 0; r < ROWS8; r++) acc[r] = vf_zero();
#if AGENTSPEC_AMX
    /* Pipelined: while block b's sums are scaled, block b + 1's tiles run (into the other set, and
       dots[(b + 1) % 2]) and block b + AMX_AHEAD's codes are unpacked (a tile load of what vector
       stores have just written waits for them: here ~45 cycles a block). A slot is rewritten two blocks
       after its tile load was issued. */
    uint8_t unpacked[AMX_AHEAD + 1][8 * REGISTER] __attribute__((aligned(64)));
    int32_t dots[2][16 * LANES] __attribute__((aligned(64)));
    if (USES_AMX(rows, halves) && nb > 0) {
        for (int b = 0; b < AMX_AHEAD && b < nb; b++) amx_unpack(codes, int_block(w, g, group, chunk, head, per, bytes, b), unpacked[b]);
        amx_block(codes, planes, q, int_block(w, g, group, chunk, head, per, bytes, 0), 0, unpacked[0], dots[0]);
    }
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *supers = w + (size_t)g * group + (size_t)(b / per) * chunk, *at = supers + head + (size_t)(b % per) * bytes;
        for (int line = 0; line < bytes; line += 64) PREFETCH(at + (USES_AMX(rows, halves) ? AHEAD + AMX_AHEAD : AHEAD) * bytes + line); /* the tiles read AMX_AHEAD blocks ahead */
        const size_t rows_at = (size_t)b * q->M; /* row r of block b: rows_at + r */
        const vi fifth = codes >= CODES_5BIT ? vi_load(at + 4 * REGISTER) : vi_zero();
        const vi sixth = codes == CODES_6BIT ? vi_load(at + 5 * REGISTER) : vi_zero();
#if AGENTSPEC_AMX
        if (USES_AMX(rows, halves) && b + 1 < nb) {
            amx_block(codes, planes, q, int_block(w, g, group, chunk, head, per, bytes, b + 1), b + 1, unpacked[(b + 1) % (AMX_AHEAD + 1)], dots[(b + 1) % 2]);
            if (b + AMX_AHEAD < nb) amx_unpack(codes, int_block(w, g, group, chunk, head, per, bytes, b + AMX_AHEAD), unpacked[(b + AMX_AHEAD) % (AMX_AHEAD + 1)]);
        }
#endif
        UNROLL for (int h = 0; h < spans; h++) {
            vi part[ROWS8][2];
            UNROLL for (int r = 0; r < ROWS8; r++) part[r][0] = part[r][1] = vi_zero();
            if (!USES_AMX(rows, halves)) {
                UNROLL for (int j = h * span; j < (h + 1) * span; j++) { /* register j: weights 4j..4j+3 of each lane's output */
                    const vi u = codes_of(codes, at, fifth, sixth, j);
#if AGENTSPEC_VNNI
                    UNROLL for (int r = 0; r < ROWS8; r++) {
                        if (r < rows) {
                            const int32_t *a = (const int32_t *)(q->codes + (rows_at + r) * ROW_BYTES(planes));
                            if (planes == 2) {
                                part[r][0] = vi_dot4(part[r][0], u, vi_set1(a[j]));
                                part[r][1] = vi_dot4(part[r][1], u, vi_set1(a[8 + j]));
                            } else {
                                part[r][j % 2] = vi_dot4(part[r][j % 2], u, vi_set1(a[j]));
                            }
                        }
                    }
#else
                    const vi low = vi_bytes16(u, 0), high = vi_bytes16(u, 1); /* codes 4j, 4j + 1 and 4j + 2, 4j + 3 as 16-bit pairs */
                    UNROLL for (int r = 0; r < ROWS8; r++) {
                        if (r < rows) {
                            const int32_t *a = (const int32_t *)(q->codes + (rows_at + r) * ROW_BYTES(planes)); /* 16-bit pairs */
                            part[r][0] = vi_keep(vi_add(part[r][0], vi_madd16(low, vi_set1(a[2 * j]))));
                            part[r][0] = vi_keep(vi_add(part[r][0], vi_madd16(high, vi_set1(a[2 * j + 1]))));
                        }
                    }
#endif
                }
            }
            const uint8_t *scale = at + scales + h * LANES * size, *minimum = at + scales + spans * LANES * size;
            const vf d = factored ? vf_mul(vf_load_half(supers), vf_from_i8(scale)) : vf_load_half(scale);
            const vf m = !mins ? vf_zero() : factored ? vf_mul(vf_load_half(supers + LANES * 2), vf_from_i8(minimum)) : vf_load_half(minimum);
            UNROLL for (int r = 0; r < ROWS8; r++) {
                if (r < rows) {
                    const size_t rb = rows_at + r;
#if AGENTSPEC_AMX
                    if (USES_AMX(rows, halves)) {
                        const int32_t *sums = dots[b % 2] + planes * r * LANES;
                        part[r][0] = vi_load(sums), part[r][1] = planes == 2 ? vi_load(sums + LANES) : vi_zero();
                    }
#endif
                    vi dot = vi_add(AGENTSPEC_VNNI && planes == 2 ? vi_shl(part[r][0], 8) : part[r][0], part[r][1]);
                    const int32_t sum = !halves ? q->sum[rb] : h == 0 ? q->half[rb] : q->sum[rb] - q->half[rb]; /* of the span's codes */
                    if (offset) dot = vi_sub(dot, vi_set1(offset * sum));
                    acc[r] = vf_fmadd(vf_from_vi(dot), vf_mul(d, vf_set1(q->scale[rb])), acc[r]);
                    if (mins) acc[r] = vf_fmadd(m, vf_set1(q->scaled_sum[rb]), acc[r]);
                }
            }
        }
    }
    const int live = N - g * LANES < LANES ? N - g * LANES : LANES;
    UNROLL for (int r = 0; r < ROWS8; r++)
        if (r < rows) vf_store_first(y + (size_t)r * N + (size_t)g * LANES, acc[r], live);
}

/* A product on integer rows, as run_threads shares it: the rows' blocks quantised, then each chunk
   of ROWS8 rows' groups of outputs. */
typedef struct {
    const float *x;
    int M, K, N;
    const uint8_t *w;
    float *y;
    agentspec_q8_rows q;
} int_job;

#define QUANTISE_JOB(PLANES)                                                                       \
    static void quantise_job_##PLANES(void *job, int ith, int nth) {                               \
        int_job *j = job;                                                                          \
        const int nb = j->K / 32;                                                                  \
        long lo, hi;                                                                               \
        share((long)j->M * nb, ith, nth, &lo, &hi);                                                \
        for (long at = lo; at < hi; at++) quantise_row_block(j->x, j->K, PLANES, &j->q, (int)(at / nb), (int)(at % nb)); \
    }
QUANTISE_JOB(1)
QUANTISE_JOB(2)

#define INT_TILES(CODES, MINS, FACTORED, HALVES, PLANES, ROWS)                                     \
    {                                                                                              \
        if (USES_AMX(ROWS, HALVES)) amx_configure((ROWS) * (PLANES));                              \
        for (long g = lo; g < hi; g++) int_tile(CODES, MINS, FACTORED, HALVES, PLANES, &part, ROWS, j->K, j->w, j->y + (size_t)r0 * j->N, j->N, (int)g); \
        if (USES_AMX(ROWS, HALVES)) AMX_RELEASE();                                                 \
    }
#define INT_JOB_NAME(CODES, MINS, FACTORED, HALVES, PLANES) int_job_##CODES##_##MINS##_##FACTORED##_##HALVES##_##PLANES
/* A thread's groups of outputs, of each chunk of ROWS8 rows in turn: one job for the whole product
   (a join a chunk cost a prefill of 200 tokens thousands of them, each waiting for the later thread) */
#define INT_JOB(CODES, MINS, FACTORED, HALVES, PLANES)                                             \
    static void INT_JOB_NAME(CODES, MINS, FACTORED, HALVES, PLANES)(void *job, int ith, int nth) { \
        const int_job *j = job;                                                                    \
        const agentspec_q8_rows q = j->q;                                                          \
        long lo, hi;                                                                               \
        share((j->N + LANES - 1) / LANES, ith, nth, &lo, &hi);                                     \
        for (int r0 = 0; r0 < j->M; r0 += ROWS8) {                                                 \
            const agentspec_q8_rows part = {q.codes + (size_t)r0 * ROW_BYTES(PLANES), q.scale + r0, q.scaled_sum + r0, q.sum + r0, q.half + r0, q.M}; \
            BY_COUNT(j->M - r0, INT_TILES, CODES, MINS, FACTORED, HALVES, PLANES)                  \
        }                                                                                          \
    }
#define INT_JOBS(CODES, MINS, FACTORED, HALVES) INT_JOB(CODES, MINS, FACTORED, HALVES, 1) INT_JOB(CODES, MINS, FACTORED, HALVES, 2)

/* The rows' blocks quantised into `rows` (taken by the caller: take_rows), then the tiles of each
   chunk of ROWS8 rows (a thread's share of either depends only on M, K, N and the thread count). */
#define INT_PRODUCT(CODES, MINS, FACTORED, HALVES, PLANES)                                         \
    {                                                                                              \
        int_job job = {x, M, K, N, (const uint8_t *)w, y, *rows};                                  \
        job.q.M = M;                                                                               \
        run_threads(threads, quantise_job_##PLANES, &job);                                         \
        run_threads(threads, INT_JOB_NAME(CODES, MINS, FACTORED, HALVES, PLANES), &job);           \
    }

static void free_rows(agentspec_q8_rows *q) {
    free(q->codes), free(q->scale), free(q->scaled_sum), free(q->sum), free(q->half);
    *q = (agentspec_q8_rows){NULL, NULL, NULL, NULL, NULL, 0};
}

/* Room for the quantised blocks of up to M rows of K inputs in `planes` planes (freed by free_rows);
   0 where it could not be taken (nothing kept: free_rows may still be called). */
static int take_rows(agentspec_q8_rows *q, int M, int K, int planes) {
    const size_t n = times((size_t)M, (size_t)(K / 32));
    q->codes = take(times(n, ROW_BYTES(planes))), q->scale = take(times(n, sizeof(float))), q->scaled_sum = take(times(n, sizeof(float)));
    q->sum = take(times(n, sizeof(int32_t))), q->half = take(times(n, sizeof(int32_t))), q->M = M;
    if (q->codes && q->scale && q->scaled_sum && q->sum && q->half) return 1;
    free_rows(q);
    return 0;
}

/* An integer layout's number (layouts.py: IntegerLayout.number): its codes, minimums (0, 1), factored
   scales (0, 1), scales per half block (0, 1) and activation planes (1: "q8", 2: "q16"). */
#define INT_LAYOUT(CODES, MINS, FACTORED, HALVES, PLANES) (((((CODES) * 2 + (MINS)) * 2 + (FACTORED)) * 2 + (HALVES)) * 2 + (PLANES) - 1)
#define INT_PLANES(layout) (((layout) & 1) + 1)
/* The layouts a GGUF file's blocks take (the others are refused: products.py never passes them) */
#define INT_LAYOUTS(EACH)                                                                          \
    EACH(CODES_BYTES, 0, 0, 0) /* Q8_0 */                                                          \
    EACH(CODES_4BIT, 0, 0, 0)  /* Q4_0 */                                                          \
    EACH(CODES_4BIT, 1, 0, 0)  /* Q4_1 */                                                          \
    EACH(CODES_4BIT, 1, 1, 0)  /* Q4_K */                                                          \
    EACH(CODES_5BIT, 0, 0, 0)  /* Q5_0 */                                                          \
    EACH(CODES_5BIT, 1, 0, 0)  /* Q5_1 */                                                          \
    EACH(CODES_5BIT, 1, 1, 0)  /* Q5_K */                                                          \
    EACH(CODES_6BIT, 0, 1, 1)  /* Q6_K */
INT_LAYOUTS(INT_JOBS)
#define INT_CASE(CODES, MINS, FACTORED, HALVES)                                                    \
    case INT_LAYOUT(CODES, MINS, FACTORED, HALVES, 1): INT_PRODUCT(CODES, MINS, FACTORED, HALVES, 1) break; \
    case INT_LAYOUT(CODES, MINS, FACTORED, HALVES, 2): INT_PRODUCT(CODES, MINS, FACTORED, HALVES, 2) break;
#define KNOWN_CASE(CODES, MINS, FACTORED, HALVES)                                                  \
    case INT_LAYOUT(CODES, MINS, FACTORED, HALVES, 1):                                             \
    case INT_LAYOUT(CODES, MINS, FACTORED, HALVES, 2): return 1;

static int int_layout_known(int layout) {
    switch (layout) {
        INT_LAYOUTS(KNOWN_CASE)
    default: return 0;
    }
}

/* x @ W.T on integer rows quantised into `rows` (room for M rows of K inputs); w: the blocks as
   Blocks.by_lanes(agentspec_lanes) lays them out. */
static int int_product(int layout, const float *x, int M, int K, const void *w, float *y, int N, int threads, const agentspec_q8_rows *rows) {
    switch (layout) {
        INT_LAYOUTS(INT_CASE)
    default: return AGENTSPEC_UNKNOWN_LAYOUT;
    }
    return AGENTSPEC_OK;
}

int agentspec_int_product(int layout, const float *x, int M, int K, const void *w, float *y, int N, int threads) {
    if (!int_layout_known(layout)) return AGENTSPEC_UNKNOWN_LAYOUT;
    if (!product_arguments(x, M, K, w, y, N, threads)) return AGENTSPEC_BAD_ARGUMENT;
    agentspec_q8_rows rows;
    if (!take_rows(&rows, M, K, INT_PLANES(layout))) return AGENTSPEC_NO_MEMORY;
    const int status = int_product(layout, x, M, K, w, y, N, threads, &rows);
    free_rows(&rows);
    return status;
}

/* ==== The decoder layers of a Llama model in one call =============================================
   Everything between the embedding and the final norm: per layer RMSNorm, the q/k/v product, the
   rotary embedding, the new keys and values written to each sequence's block, causal attention of
   each sequence over its own block, the output product and residual, RMSNorm, the gate/up product,
   SiLU times up, the down product and residual. The same operations in the same order as the fused
   pass in Python (fused.py), without ~120 framework calls per pass. Each token's arithmetic
   depends only on its own row and its sequence's keys and values: row-invariant, like the products. */

/* agentspec_blocks, agentspec_layer, agentspec_segment and INTEGER_KIND: blocks.h */

void agentspec_struct_sizes(size_t sizes[3]) {
    sizes[0] = sizeof(agentspec_blocks), sizes[1] = sizeof(agentspec_layer), sizes[2] = sizeof(agentspec_segment);
}

/* 16 keys' (values') elements from a block of float32 or, with `half` (a compile-time constant at
   each call site), float16 — converted exactly to float32. */
INLINE v16 load_kv(const void *kv, size_t index, const int half) {
    return half ? v16_load_half((const uint16_t *)kv + index) : v16_load((const float *)kv + index);
}

/* Layer l's keys (which = 0) or values (1) of key/value head h in a sequence's block: [capacity, head_dim]
   of float16 (`half`) or float32. */
static inline void *kv_head(const agentspec_segment *seg, int l, int which, int h, int kv_heads, int head_dim, int half) {
    return (char *)(which ? seg->values : seg->keys) + ((size_t)l * kv_heads + h) * (size_t)seg->capacity * head_dim * (half ? 2 : 4);
}

/* One token's key (value) of `head_dim` elements into slot `slot` of a head's keys (values), rounded
   to nearest-even for float16 (as torch rounds float32 to float16). */
static inline void store_kv(void *kv, size_t slot, const float *x, int head_dim, int half) {
    if (!half) {
        memcpy((float *)kv + slot * head_dim, x, sizeof(float) * head_dim);
        return;
    }
    for (int i = 0; i < head_dim; i += 16) /* head_dim: a multiple of 16 (blocks.py) */
        v16_store_half((uint16_t *)kv + slot * head_dim + i, v16_load(x + i));
}

/* e^x, 16 lanes (Cephes' single-precision polynomial, within 2 ulp; the same bits for a lane
   whatever its neighbours): 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2. Below -87 it is
   e^-87 (~1.6e-38: nothing below matters here); above 89, infinite. */
INLINE v16 exp16(v16 x) {
    x = v16_min(v16_max(x, v16_set1(-87.0f)), v16_set1(89.0f));
    const v16 n = v16_round(v16_mul(x, v16_set1(1.44269504088896341f)));
    v16 r = v16_fnmadd(n, v16_set1(0.693359375f), x);
    r = v16_fnmadd(n, v16_set1(-2.12194440e-4f), r);
    v16 p = v16_set1(1.9875691500e-4f);
    p = v16_fmadd(p, r, v16_set1(1.3981999507e-3f));
    p = v16_fmadd(p, r, v16_set1(8.3334519073e-3f));
    p = v16_fmadd(p, r, v16_set1(4.1665795894e-2f));
    p = v16_fmadd(p, r, v16_set1(1.6666665459e-1f));
    p = v16_fmadd(p, r, v16_set1(5.0000001201e-1f));
    p = v16_add(v16_fmadd(p, v16_mul(r, r), r), v16_set1(1.0f));
    return v16_scale2(p, n);
}

/* tanh(u) = 1 - 2 / (e^2u + 1), 16 lanes: -1 and 1 where e^2u saturates */
INLINE v16 tanh16(v16 u) { return v16_sub(v16_set1(1.0f), v16_div(v16_set1(2.0f), v16_add(exp16(v16_add(u, u)), v16_set1(1.0f)))); }

/* Whether `w` is blocks the kernels read for a product of N outputs: each part of a known kind with its
   blocks, and the parts' outputs adding up to N where there are several. */
static int blocks_status(const agentspec_blocks *w, int N) {
    long outputs = 0;
    int parts = 0;
    for (const agentspec_blocks *p = w; p; p = p->next) {
        if (p->kind < 0 || (p->kind >= INTEGER_KIND && !int_layout_known(p->kind - INTEGER_KIND))) return AGENTSPEC_UNKNOWN_LAYOUT;
        if (!p->few || (p->kind < INTEGER_KIND && !p->many) || ++parts > N) return AGENTSPEC_BAD_ARGUMENT; /* (a chain that loops runs out of outputs) */
        if (w->next && p->outputs <= 0) return AGENTSPEC_BAD_ARGUMENT;
        outputs += p->outputs;
    }
    return !w->next || outputs == N ? AGENTSPEC_OK : AGENTSPEC_BAD_ARGUMENT;
}

/* y = x @ W.T of M rows of K inputs (blocks_status said yes), with the caller's room for the parts of
   a chain (`part`: M rows of N) and for integer rows (`rows`: M rows of K) */
static void blocks_product(const agentspec_blocks *w, const float *x, int M, int K, float *y, int N, int threads, float *part, const agentspec_q8_rows *rows) {
    if (w->next) { /* parts of different kinds: each part's product, its outputs copied into their columns */
        int at = 0;
        for (const agentspec_blocks *p = w; p; p = p->next) {
            agentspec_blocks one = *p;
            one.next = NULL;
            blocks_product(&one, x, M, K, part, p->outputs, threads, NULL, rows);
            for (int m = 0; m < M; m++) memcpy(y + (size_t)m * N + at, part + (size_t)m * p->outputs, sizeof(float) * (size_t)p->outputs);
            at += p->outputs;
        }
        return;
    }
    switch (w->kind) {
    case 0: agentspec_q4_1_product(x, M, K, w->few, w->many, y, N, threads); break;
    case 1: agentspec_q8_0_product(x, M, K, w->few, w->many, y, N, threads); break;
    case 2: agentspec_q8_16_product(x, M, K, w->few, w->many, y, N, threads); break;
    case 3: agentspec_q8_1_product(x, M, K, w->few, w->many, y, N, threads); break;
    default: int_product(w->kind - INTEGER_KIND, x, M, K, w->few, y, N, threads, rows); break; /* integer rows */
    }
}

/* LlamaRMSNorm of each row: weight * (x * 1/sqrt(mean(x^2) + eps)). */
static void rms_norm(const float *x, int rows, int H, const float *weight, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * H;
        v16 acc = v16_zero();
        int i = 0;
        for (; i + 16 <= H; i += 16) {
            const v16 v = v16_load(xr + i);
            acc = v16_fmadd(v, v, acc);
        }
        float sum = v16_sum(acc);
        for (; i < H; i++) sum += xr[i] * xr[i];
        const float inverse = 1.0f / sqrtf(sum / (float)H + eps);
        for (int j = 0; j < H; j++) out[(size_t)r * H + j] = weight[j] * (xr[j] * inverse);
    }
}

/* Causal attention of a run of `tokens` consecutive tokens of one sequence, each with `groups` query
   heads (token t's at q + t * q_stride, head_dim apart) that share one key/value head: token t over
   the first seen[t] keys and values ([seen, head_dim] each); softmax of the scaled scores, times the
   values, into out + t * out_stride (the heads side by side). `chunks` = head_dim / 16, a
   compile-time constant at each call site (attend), so a query and the sums live in registers.
   The keys and values are read once for all the run's queries: 16 keys at a time, reused from cache
   by each query's scores; each value once for up to 12 / chunks queries' sums — a verification's
   tokens share the reads of their sequence's cache instead of streaming it once each. Every query's
   arithmetic is the same whatever shares the run, the job or the pass: a key's score is one 16-lane
   accumulation summed by v16_sums' tree, over that query's own keys, and its values are summed in
   key order up to its own `seen`. */
INLINE void attend_chunks(const int chunks, const int key_half, const int value_half, const float *q, size_t q_stride, int groups, int tokens,
                          const int *seen, const void *keys, const void *values, float scaling, float softcap, float *p, size_t stride, float *out,
                          size_t out_stride) {
    const int head_dim = 16 * chunks, group = chunks <= 4 ? 12 / chunks : 1, queries = groups * tokens;
    int longest = 0;
    for (int t = 0; t < tokens; t++) longest = seen[t] > longest ? seen[t] : longest;
    for (int s0 = 0; s0 < longest; s0 += 16) { /* scores: each 16 keys for every query that sees them */
        for (int h = 0; h < queries; h++) {
            const int saw = seen[h / groups];
            if (s0 >= saw) continue;
            const int live = saw - s0 < 16 ? saw - s0 : 16;
            const float *qh = q + (size_t)(h / groups) * q_stride + (size_t)(h % groups) * head_dim;
            v16 query[8], dots[16];
            UNROLL for (int i = 0; i < 8; i++) if (i < chunks) query[i] = v16_load(qh + 16 * i);
            UNROLL for (int j = 0; j < 16; j++) {
                dots[j] = v16_zero();
                if (j < live) {
                    const size_t k = (size_t)(s0 + j) * head_dim;
                    UNROLL for (int i = 0; i < 8; i++) if (i < chunks) dots[j] = v16_fmadd(query[i], load_kv(keys, k + 16 * i, key_half), dots[j]);
                }
            }
            v16 scores = v16_mul(v16_sums(dots), v16_set1(scaling));
            if (softcap > 0.0f) /* Gemma 2: tanh(score / cap) * cap */
                scores = v16_mul(tanh16(v16_div(scores, v16_set1(softcap))), v16_set1(softcap));
            v16_store_first(p + h * stride + s0, scores, live);
        }
    }
    float total[queries];
    for (int h = 0; h < queries; h++) { /* softmax numerators and their sum, 16 scores at a time (the last chunk's tail left out) */
        float *ph = p + h * stride;
        const int saw = seen[h / groups];
        v16 highest = v16_set1(-INFINITY), sum16 = v16_zero();
        for (int s = 0; s < saw; s += 16) highest = v16_max(highest, v16_load_first(ph + s, saw - s, -INFINITY));
        const v16 top = v16_set1(v16_top(highest));
        for (int s = 0; s < saw; s += 16) {
            const v16 e = exp16(v16_sub(v16_load_first(ph + s, saw - s, 0.0f), top));
            v16_store_first(ph + s, e, saw - s);
            sum16 = v16_add(sum16, v16_keep_first(e, saw - s));
        }
        total[h] = v16_sum(sum16);
    }
    for (int h0 = 0; h0 < queries; h0 += group) { /* the numerators' weighted values in key order, divided by their sum */
        const int n = queries - h0 < group ? queries - h0 : group;
        int until[12], reach = 0; /* each query's keys, and the most of them */
        UNROLL for (int g = 0; g < 12; g++) {
            until[g] = g < n ? seen[(h0 + g) / groups] : 0;
            reach = until[g] > reach ? until[g] : reach;
        }
        v16 sums[12][8];
        UNROLL for (int g = 0; g < 12; g++) UNROLL for (int i = 0; i < 8; i++) sums[g][i] = v16_zero();
        for (int s = 0; s < reach; s++) {
            v16 v[8];
            UNROLL for (int i = 0; i < 8; i++) if (i < chunks) v[i] = load_kv(values, (size_t)s * head_dim + 16 * i, value_half);
            UNROLL for (int g = 0; g < 12; g++) {
                if (g < group && s < until[g]) {
                    const v16 weight = v16_set1(p[(h0 + g) * stride + s]);
                    UNROLL for (int i = 0; i < 8; i++) if (i < chunks) sums[g][i] = v16_fmadd(weight, v[i], sums[g][i]);
                }
            }
        }
        UNROLL for (int g = 0; g < 12; g++)
            if (g < group && g < n) {
                float *oh = out + (size_t)((h0 + g) / groups) * out_stride + (size_t)((h0 + g) % groups) * head_dim;
                UNROLL for (int i = 0; i < 8; i++)
                    if (i < chunks) v16_store(oh + 16 * i, v16_div(sums[g][i], v16_set1(total[h0 + g])));
            }
    }
}

#define ATTEND_CHUNKS(KEY_HALF, VALUE_HALF, CHUNKS) \
    attend_chunks(CHUNKS, KEY_HALF, VALUE_HALF, q, q_stride, groups, tokens, seen, keys, values, scaling, softcap, p, stride, out, out_stride);

/* Keys and values each float32 or float16 (key_half, value_half: compile-time constants inside). */
static void attend(int key_half, int value_half, const float *q, size_t q_stride, int groups, int tokens, const int *seen, int head_dim, const void *keys,
                   const void *values, float scaling, float softcap, float *p, size_t stride, float *out, size_t out_stride) {
    if (key_half && value_half) /* head_dim <= 128 (blocks.py) */
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 1, 1)
    else if (value_half)
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 0, 1)
    else if (key_half)
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 1, 0)
    else
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 0, 0)
}

/* GELU(gate) * up of one row, the tanh approximation as torch computes it (gelu_pytorch_tanh):
   0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(u) = 1 - 2 / (e^2u + 1); a tail of fewer than
   16 through a padded copy, so every element takes the same operations. */
static void gelu_times(const float *gate, const float *value, int n, float *act) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 g = v16_load(gate + i);
        const v16 u = v16_mul(v16_set1(0.7978845608028654f), v16_fmadd(v16_mul(v16_set1(0.044715f), g), v16_mul(g, g), g));
        const v16 gelu = v16_mul(v16_mul(v16_set1(0.5f), g), v16_add(v16_set1(1.0f), tanh16(u)));
        v16_store(act + i, v16_mul(gelu, v16_load(value + i)));
    }
    if (i < n) {
        float g[16] = {0}, u[16] = {0}, a[16];
        memcpy(g, gate + i, sizeof(float) * (n - i));
        memcpy(u, value + i, sizeof(float) * (n - i));
        gelu_times(g, u, 16, a);
        memcpy(act + i, a, sizeof(float) * (n - i));
    }
}

/* hidden += delta (times `scale` where it is not 1: Granite's residual multiplier) */
static void add_residual(float *hidden, const float *delta, size_t n, float scale) {
    if (scale == 1.0f)
        for (size_t i = 0; i < n; i++) hidden[i] += delta[i];
    else
        for (size_t i = 0; i < n; i++) hidden[i] += delta[i] * scale;
}

/* SiLU(gate) * up of one row, gate / (1 + e^-gate) as torch computes it; a tail of fewer than 16
   through a padded copy, so every element takes the same operations. */
static void silu_times(const float *gate, const float *value, int n, float *act) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 g = v16_load(gate + i);
        const v16 silu = v16_div(g, v16_add(v16_set1(1.0f), exp16(v16_sub(v16_zero(), g))));
        v16_store(act + i, v16_mul(silu, v16_load(value + i)));
    }
    if (i < n) {
        float g[16] = {0}, u[16] = {0}, a[16];
        memcpy(g, gate + i, sizeof(float) * (n - i));
        memcpy(u, value + i, sizeof(float) * (n - i));
        silu_times(g, u, 16, a);
        memcpy(act + i, a, sizeof(float) * (n - i));
    }
}

/* Whether the layers' counts, sequences and weights are ones the kernels read (a status of blocks.h). */
static int layers_status(const float *hidden, int T, int H, int heads, int kv_heads, int head_dim, int intermediate, int layers,
                         const agentspec_layer *weights, const float *cos, const float *sin, int rotary_dim, const agentspec_segment *segments, int nseg,
                         int threads) {
    if (T < 0 || H <= 0 || H % 32 || heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim < 16 || head_dim > 128 || head_dim % 16 ||
        intermediate <= 0 || intermediate % 32 || intermediate > INT32_MAX / 2 || layers < 0 || rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 ||
        nseg < 0 || threads < 1)
        return AGENTSPEC_BAD_ARGUMENT;
    const long q_size = (long)heads * head_dim, width = q_size + 2L * kv_heads * head_dim; /* (head_dim <= 128: no overflow in a long) */
    if (width > INT32_MAX || q_size % 32 || (T && !hidden) || (layers && !weights) || (nseg && !segments)) return AGENTSPEC_BAD_ARGUMENT;
    for (int g = 0; g < nseg; g++) { /* each sequence's tokens in the pass, and its keys and values in its block */
        const agentspec_segment *seg = segments + g;
        if (seg->start < 0 || seg->start > seg->stop || seg->stop > T || seg->past < 0 || (long)seg->past + (seg->stop - seg->start) > seg->capacity ||
            !seg->keys || !seg->values)
            return AGENTSPEC_BAD_ARGUMENT;
    }
    for (int l = 0; l < layers; l++) {
        const agentspec_layer *w = weights + l;
        if (!w->norm1 || !w->norm2 || !w->q_norm != !w->k_norm || w->window < 0 || w->rotary < 0 || (w->rotary && (!rotary_dim || !cos || !sin)))
            return AGENTSPEC_BAD_ARGUMENT;
        const int status[4] = {blocks_status(&w->qkv, (int)width), blocks_status(&w->o, H), blocks_status(&w->gate_up, 2 * intermediate),
                               blocks_status(&w->down, H)};
        for (int i = 0; i < 4; i++)
            if (status[i]) return status[i];
    }
    return AGENTSPEC_OK;
}

/* The steps of a layer between its products that work row by row (a token's row reads only itself,
   its sequence's keys and values and the layer's weights), as run_threads shares them by rows: on the
   caller alone for a few rows (a pass of a few positions: microseconds), else on every thread (a
   prefill: 5% of its time was the caller's alone while the workers waited). The same operations on
   each row either way, so the same bits. */
enum { ROWS_NORM1, ROWS_QKV, ROWS_ATTENTION_OUT, ROWS_ACTIVATION, ROWS_MLP_OUT };
#define SHARED_ROWS 16 /* rows from which these steps are shared among the threads */
typedef struct {
    const agentspec_layer *w;
    int l, stage, T, H, heads, kv_heads, head_dim, intermediate, width, q_size, kv_size, rotary_dim, key_half, value_half;
    float *hidden, *normed, *qkv, *up, *delta;
    const float *cos, *sin;
    float residual_scale;
    const agentspec_segment *segments;
    int nseg;
} rows_job;

static void layer_rows(const rows_job *r, int t0, int t1) {
    const agentspec_layer *w = r->w;
    const int H = r->H, width = r->width, head_dim = r->head_dim, q_size = r->q_size, rotary_dim = r->rotary_dim, half = rotary_dim / 2;
    const size_t rows = (size_t)(t1 - t0);
    switch (r->stage) {
    case ROWS_NORM1: rms_norm(r->hidden + (size_t)t0 * H, (int)rows, H, w->norm1, w->eps1, r->normed + (size_t)t0 * H); break;
    case ROWS_QKV:
        for (int t = t0; t < t1; t++) {
            float *row = r->qkv + (size_t)t * width;
            if (w->qkv_bias)
                for (int i = 0; i < width; i++) row[i] += w->qkv_bias[i];
            if (w->q_norm) { /* in place: each head's sum of squares is taken before it is written */
                rms_norm(row, r->heads, head_dim, w->q_norm, w->qk_eps, row);
                rms_norm(row + q_size, r->kv_heads, head_dim, w->k_norm, w->qk_eps, row + q_size);
            }
            /* rotary embedding of queries and keys: x * cos + rotate_half(x) * sin over the first rotary_dim elements */
            if (w->rotary) {
                const size_t table = (size_t)(w->rotary - 1) * r->T;
                const float *c = r->cos + (table + t) * rotary_dim, *s = r->sin + (table + t) * rotary_dim;
                for (int h = 0; h < r->heads + r->kv_heads; h++) {
                    float *x = row + (size_t)h * head_dim;
                    float rotated[rotary_dim];
                    for (int i = 0; i < half; i++) {
                        rotated[i] = x[i] * c[i] + (-x[i + half]) * s[i];
                        rotated[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
                    }
                    memcpy(x, rotated, sizeof(float) * rotary_dim);
                }
            }
        }
        /* these rows' keys and values into each sequence's block (its tokens among them) */
        for (int g = 0; g < r->nseg; g++) {
            const agentspec_segment *seg = r->segments + g;
            const int first = seg->start > t0 ? seg->start : t0, last = seg->stop < t1 ? seg->stop : t1;
            for (int t = first; t < last; t++) {
                const float *row = r->qkv + (size_t)t * width;
                const size_t slot = (size_t)(seg->past + t - seg->start);
                for (int h = 0; h < r->kv_heads; h++) {
                    store_kv(kv_head(seg, r->l, 0, h, r->kv_heads, head_dim, r->key_half), slot, row + q_size + (size_t)h * head_dim, head_dim, r->key_half);
                    store_kv(kv_head(seg, r->l, 1, h, r->kv_heads, head_dim, r->value_half), slot, row + q_size + r->kv_size + (size_t)h * head_dim,
                             head_dim, r->value_half);
                }
            }
        }
        break;
    case ROWS_ATTENTION_OUT:
    case ROWS_MLP_OUT: {
        const int attention = r->stage == ROWS_ATTENTION_OUT;
        const float *post = attention ? w->post_attention : w->post_mlp;
        float *delta = r->delta + (size_t)t0 * H, *hidden = r->hidden + (size_t)t0 * H;
        if (post) rms_norm(delta, (int)rows, H, post, w->post_eps, delta);
        add_residual(hidden, delta, rows * H, r->residual_scale);
        if (attention) rms_norm(hidden, (int)rows, H, w->norm2, w->eps2, r->normed + (size_t)t0 * H);
        break;
    }
    case ROWS_ACTIVATION:
        for (int t = t0; t < t1; t++) {
            const float *up = r->up + (size_t)t * 2 * r->intermediate;
            (w->gelu ? gelu_times : silu_times)(up, up + r->intermediate, r->intermediate, r->normed + (size_t)t * r->intermediate);
        }
        break;
    }
}

static void rows_share(void *argument, int ith, int nth) {
    const rows_job *r = argument;
    long lo, hi;
    share(r->T, ith, nth, &lo, &hi);
    layer_rows(r, (int)lo, (int)hi);
}

/* Step `stage` of the layer on every row of the pass */
static void run_rows(rows_job *r, int stage, int threads) {
    r->stage = stage;
    if (r->T < SHARED_ROWS || threads <= 1)
        layer_rows(r, 0, r->T);
    else
        run_threads(threads, rows_share, r);
}

/* The attention of a layer, as run_threads shares it: a job per (run of tokens, key/value head). */
typedef struct {
    const agentspec_layer *w;
    int l;
    const agentspec_segment *segments;
    const int *run_first, *run_segment;
    int length, kv_heads, groups, head_dim, key_half, value_half;
    const float *qkv;
    int width;
    float *scores;         /* a thread's room: `room` floats from scores + ith * room */
    size_t room;
    int score_stride;
    float scaling;
    float *attn;
    int q_size, jobs;
} attention_job;

static void attention_share(void *argument, int ith, int nth) {
    const attention_job *a = argument;
    const int kv_heads = a->kv_heads, head_dim = a->head_dim, groups = a->groups;
    long lo, hi;
    share(a->jobs, ith, nth, &lo, &hi);
    for (long job = lo; job < hi; job++) {
        const int r = (int)job / kv_heads, kvh = (int)job % kv_heads, t0 = a->run_first[r];
        const agentspec_segment *seg = a->segments + a->run_segment[r];
        const int tokens = seg->stop - t0 < a->length ? seg->stop - t0 : a->length;
        int seen[tokens];
        for (int i = 0; i < tokens; i++) seen[i] = seg->past + (t0 + i - seg->start) + 1;
        /* a window (runs of one token): the keys (values) before it left out */
        const int first = a->w->window && seen[0] > a->w->window ? seen[0] - a->w->window : 0;
        seen[0] -= first;
        attend(a->key_half, a->value_half, a->qkv + (size_t)t0 * a->width + (size_t)kvh * groups * head_dim, a->width, groups, tokens, seen, head_dim,
               (const char *)kv_head(seg, a->l, 0, kvh, kv_heads, head_dim, a->key_half) + (size_t)first * head_dim * (a->key_half ? 2 : 4),
               (const char *)kv_head(seg, a->l, 1, kvh, kv_heads, head_dim, a->value_half) + (size_t)first * head_dim * (a->value_half ? 2 : 4),
               a->scaling, a->w->softcap, a->scores + (size_t)ith * a->room, a->score_stride,
               a->attn + (size_t)t0 * a->q_size + (size_t)kvh * groups * head_dim, a->q_size);
    }
}

/* The decoder layers of a pass (arch.py's block; the embedding and the logits stay in Python): per
   layer RMSNorm, the q/k/v product (plus its bias), per-head q/k RMSNorm, the rotary embedding of the
   first `rotary_dim` elements of each head (cos, sin: [tables, T, rotary_dim], the layer's table),
   attention (within the layer's window, scores soft-capped where it caps them), the output product (RMSNorm'd where the layer has a post
   norm), the residual (times `residual_scale`), RMSNorm, gate/up, SiLU or GELU(gate) * up, down (its
   post norm), the residual. Counts, sequences and weights are checked (layers_status) and the working
   memory taken before any work: a refused call changed nothing. */
int agentspec_layers(float *hidden, int T, int H, int heads, int kv_heads, int head_dim, int intermediate,
                     int layers, const agentspec_layer *weights, const float *cos, const float *sin, int rotary_dim, float scaling,
                     float residual_scale, const agentspec_segment *segments, int nseg, int key_half, int value_half, int threads) {
    const int status = layers_status(hidden, T, H, heads, kv_heads, head_dim, intermediate, layers, weights, cos, sin, rotary_dim, segments, nseg, threads);
    if (status) return status;
    const int q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    const int groups = heads / kv_heads;
    int longest = 0;
    for (int s = 0; s < nseg; s++)
        if (segments[s].past + segments[s].stop - segments[s].start > longest) longest = segments[s].past + segments[s].stop - segments[s].start;
    /* the widest product whose blocks are a chain of parts (their outputs in turn), and whether any takes integer rows */
    int chained = 0, integer = 0;
    for (int l = 0; l < layers; l++) {
        const agentspec_blocks *products[4] = {&weights[l].qkv, &weights[l].o, &weights[l].gate_up, &weights[l].down};
        const int outputs[4] = {width, H, 2 * intermediate, H};
        for (int i = 0; i < 4; i++) {
            if (products[i]->next && outputs[i] > chained) chained = outputs[i];
            for (const agentspec_blocks *p = products[i]; p; p = p->next) integer |= p->kind >= INTEGER_KIND;
        }
    }
    const int widest = H > intermediate ? H : intermediate, inputs = widest > q_size ? widest : q_size; /* of the products' inputs */
    float *normed = take(times(times((size_t)T, (size_t)widest), sizeof(float)));
    float *qkv = take(times(times((size_t)T, (size_t)width), sizeof(float)));
    float *attn = take(times(times((size_t)T, (size_t)q_size), sizeof(float)));
    float *up = take(times(times((size_t)T, 2 * (size_t)intermediate), sizeof(float)));
    float *delta = take(times(times((size_t)T, (size_t)H), sizeof(float)));
    float *part = take(times(times((size_t)T, (size_t)chained), sizeof(float)));
    agentspec_q8_rows rows = {NULL, NULL, NULL, NULL, NULL, 0};
    const int have_rows = !integer || take_rows(&rows, T, inputs, 2);
    /* Attention's jobs: a run of up to `run` consecutive tokens of one sequence and one key/value head
       (a run's tokens share each read of the cache), runs short enough that the threads have about
       two jobs each; one token a run in layers with a window (each token's keys start elsewhere). */
    const int workers = threads, splits = (2 * workers + kv_heads - 1) / kv_heads;
    int run = 1;
    for (int g = 0; g < nseg; g++) {
        const int tokens = segments[g].stop - segments[g].start, length = (tokens + splits - 1) / splits;
        run = length > run ? length : run;
    }
    /* each run's first token and sequence: at most one run a token */
    int *run_first = take(times((size_t)T + 1, sizeof(int))), *run_segment = take(times((size_t)T + 1, sizeof(int)));
    float *scores = take(times(times(times((size_t)workers, (size_t)groups), times((size_t)run, (size_t)longest + 16)), sizeof(float)));
    if (!normed || !qkv || !attn || !up || !delta || !part || !have_rows || !run_first || !run_segment || !scores) {
        free(normed), free(qkv), free(attn), free(up), free(delta), free(part), free_rows(&rows), free(run_first), free(run_segment), free(scores);
        return AGENTSPEC_NO_MEMORY;
    }
    rows_job steps = {NULL, 0, 0, T, H, heads, kv_heads, head_dim, intermediate, width, q_size, kv_size, rotary_dim, key_half, value_half,
                      hidden, normed, qkv, up, delta, cos, sin, residual_scale, segments, nseg};
    for (int l = 0; l < layers; l++) {
        const agentspec_layer *w = weights + l;
        steps.w = w, steps.l = l;
        run_rows(&steps, ROWS_NORM1, threads);
        blocks_product(&w->qkv, normed, T, H, qkv, width, threads, part, &rows);
        run_rows(&steps, ROWS_QKV, threads); /* bias, q/k norms, rotary embedding, the new keys and values into each sequence's block */
        /* causal attention: each token's query heads over its sequence's keys up to its own position,
           a job per (run of tokens, key/value head), all the pass's sequences in one parallel loop */
        const int length = w->window ? 1 : run;
        int jobs = 0;
        for (int g = 0; g < nseg; g++)
            for (int t = segments[g].start; t < segments[g].stop; t += length) run_first[jobs] = t, run_segment[jobs++] = g;
        attention_job job = {w, l, segments, run_first, run_segment, length, kv_heads, groups, head_dim, key_half, value_half,
                             qkv, width, scores, (size_t)groups * run * (longest + 16), longest + 16, scaling, attn, q_size, jobs * kv_heads};
        run_threads(threads, attention_share, &job);
        blocks_product(&w->o, attn, T, q_size, delta, H, threads, part, &rows);
        run_rows(&steps, ROWS_ATTENTION_OUT, threads); /* (post norm,) residual, RMSNorm */
        blocks_product(&w->gate_up, normed, T, H, up, 2 * intermediate, threads, part, &rows);
        run_rows(&steps, ROWS_ACTIVATION, threads);
        blocks_product(&w->down, normed, T, intermediate, delta, H, threads, part, &rows);
        run_rows(&steps, ROWS_MLP_OUT, threads); /* (post norm,) residual */
    }
    free(normed), free(qkv), free(attn), free(up), free(delta), free(part), free_rows(&rows), free(run_first), free(run_segment), free(scores);
    return AGENTSPEC_OK;
}

/* ==== GGUF blocks into the integer products' layout ===============================================
   What layouts.py does in two steps, tensor_blocks (the file's blocks as Blocks: codes, scales,
   minimums, the K-quants' factors) and Blocks.by_lanes (their layout for agentspec_int_product), in
   one pass over the file's bytes, for the rows of a run: the same bytes, about twenty times faster.
   `rows[i]` is output i's row of GGUF blocks (the caller has undone llama.cpp's interleaving of the
   rotary halves by the order of the pointers), `types[i]` its ggml type. */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

/* One block of 32 weights as tensor_blocks reads it (READ_AS): its codes, its scale (Q6_K: one per
   16 weights) and minimum as float32, and a K-quant's 8-bit factors and super-block values. */
typedef struct {
    int8_t code[32];   /* every kind's fits: Q8_0's bytes, Q8_1's 5 bits, Q8_16's signed 6, Q4_1's 4 */
    float scale[2], min;
    int8_t factor[2];   /* K-quants: of the scale (Q6_K: of each half's), then of the minimum */
    float super[2];     /* K-quants: d, then -dmin */
} gguf_block;

static float half_value(const uint8_t *p) {
    const uint32_t bits = p[0] | (uint32_t)p[1] << 8, exponent = (bits >> 10) & 31, mantissa = bits & 1023;
    if (exponent == 0) { /* zero or subnormal: mantissa 2^-24, exactly */
        const float value = (float)mantissa * 0x1p-24f;
        return bits & 0x8000 ? -value : value;
    }
    const uint32_t f = (bits & 0x8000) << 16 | (exponent == 31 ? 255u << 23 : (exponent + 112) << 23) | mantissa << 13;
    float value;
    memcpy(&value, &f, 4);
    return value;
}

/* Whether float32 `x` is a float16 value (as torch's x.to(float16).float() == x decides: infinities
   are, NaN is not); *bits: its float16 bits where it is. */
static int half_bits(float x, uint16_t *bits) {
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint16_t sign = (f >> 16) & 0x8000;
    const int exponent = (int)((f >> 23) & 255) - 127;
    const uint32_t mantissa = f & 0x7fffff;
    if (exponent == 128) {
        *bits = sign | 0x7c00;
        return mantissa == 0;
    }
    if (exponent == -127) { /* zero, or a float32 subnormal: below float16's least value 2^-24 */
        *bits = sign;
        return mantissa == 0;
    }
    if (exponent > 15) return 0;
    if (exponent >= -14) {
        *bits = sign | (uint16_t)((exponent + 15) << 10) | (uint16_t)(mantissa >> 13);
        return (mantissa & 0x1fff) == 0;
    }
    const int shift = -1 - exponent; /* float16 subnormal: (1.m) 2^e as k 2^-24, k = (2^23 + m) >> (-1 - e) */
    const uint32_t full = mantissa | 0x800000;
    if (shift > 24) return 0;
    *bits = sign | (uint16_t)(full >> shift);
    return (full & ((1u << shift) - 1)) == 0;
}

static int gguf_block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q5_1: return 24;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

static int gguf_super(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? 8 : 1; }

/* The 6-bit scale and minimum factors of block s of a Q4_K or Q5_K super-block (`packed`: its 12
   bytes of them). */
static inline void k_scale_min(const uint8_t *packed, int s, int *scale, int *min) {
    *scale = s < 4 ? packed[s] & 63 : (packed[s + 4] & 15) | ((packed[s - 4] >> 6) << 4);
    *min = s < 4 ? packed[s + 4] & 63 : (packed[s + 4] >> 4) | ((packed[s] >> 6) << 4);
}

/* Block b (of 32 weights) of a row of `type`. */
static void gguf_read_block(const uint8_t *row, int type, int b, gguf_block *out) {
    const uint8_t *p = row + (size_t)(b / gguf_super(type)) * gguf_block_bytes(type);
    const int s = b % gguf_super(type); /* the block within its K-quant super-block */
    out->min = 0.0f, out->scale[1] = 0.0f;
    switch (type) {
    case GGML_Q4_0:
    case GGML_Q4_1:
    case GGML_Q5_0:
    case GGML_Q5_1: {
        const int mins = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
        const uint8_t *nibbles = p + 2 + 2 * mins + 4 * five;
        const uint32_t high = five ? p[2 + 2 * mins] | (uint32_t)p[3 + 2 * mins] << 8 | (uint32_t)p[4 + 2 * mins] << 16 | (uint32_t)p[5 + 2 * mins] << 24 : 0;
        const int offset = mins ? 0 : five ? 16 : 8;
        for (int j = 0; j < 16; j++) {
            out->code[j] = (int8_t)((int)((nibbles[j] & 15) | ((high >> j) & 1) << 4) - offset);
            out->code[j + 16] = (int8_t)((int)((nibbles[j] >> 4) | ((high >> (j + 16)) & 1) << 4) - offset);
        }
        out->scale[0] = half_value(p);
        if (mins) out->min = half_value(p + 2);
        break;
    }
    case GGML_Q8_0:
        for (int j = 0; j < 32; j++) out->code[j] = (int8_t)p[2 + j];
        out->scale[0] = half_value(p);
        break;
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const uint8_t *nibbles = p + (type == GGML_Q5_K ? 48 : 16);
        int scale, min;
        k_scale_min(p + 4, s, &scale, &min);
        for (int j = 0; j < 32; j++) {
            const int code = (nibbles[32 * (s / 2) + j] >> (4 * (s % 2))) & 15;
            out->code[j] = (int8_t)(type == GGML_Q5_K ? code | ((p[16 + j] >> s) & 1) << 4 : code);
        }
        const float d = half_value(p), dmin = half_value(p + 2);
        out->scale[0] = d * (float)scale, out->min = -(dmin * (float)min);
        out->factor[0] = (int8_t)scale, out->factor[1] = (int8_t)min;
        out->super[0] = d, out->super[1] = -dmin;
        break;
    }
    case GGML_Q6_K: {
        const int n = s / 4, shift = 4 * ((s / 2) % 2), first = 32 * (s % 2), k = s % 4;
        for (int j = 0; j < 32; j++)
            out->code[j] = (int8_t)((((p[64 * n + first + j] >> shift) & 15) | ((p[128 + 32 * n + j] >> (2 * k)) & 3) << 4) - 32);
        const float d = half_value(p + 208);
        for (int h = 0; h < 2; h++) out->factor[h] = (int8_t)p[192 + 2 * s + h], out->scale[h] = d * (float)out->factor[h];
        out->super[0] = d, out->super[1] = 0.0f;
        break;
    }
    }
}

/* Whether rows[0..n) are rows of K weights of types this reads (K a whole number of their blocks), and
   the call's other counts ones it takes. */
static int gguf_known(const uint8_t *const *rows, const int *types, int n, int K, int threads) {
    if (n <= 0 || K <= 0 || K % 32 || threads < 1 || !rows || !types) return 0;
    for (int i = 0; i < n; i++)
        if (!gguf_block_bytes(types[i]) || K % (32 * gguf_super(types[i])) || !rows[i]) return 0;
    return 1;
}

/* What the integer layout of a block depends on (Blocks.code_statistics): whether its scales (and
   minimum) are no float16 values, its least and largest code. (Q4_1 blocks are compared as their
   packed bytes there, unpacked here: integer_layout_of does not look at Q4_1's codes.) */
static inline void block_statistics(const gguf_block *block, int type, int *factored, int *low, int *high) {
    const int mins = type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K;
    int least = block->code[0], most = block->code[0];
    uint16_t bits;
    for (int j = 1; j < 32; j++) least = block->code[j] < least ? block->code[j] : least, most = block->code[j] > most ? block->code[j] : most;
    *low = least < *low ? least : *low, *high = most > *high ? most : *high;
    /* once one is found, or Q6_K's (integer_layout_of keeps its factors whatever they are), no more to look for */
    if (!*factored && type != GGML_Q6_K) *factored = !half_bits(block->scale[0], &bits) || (mins && !half_bits(block->min, &bits));
}

/* The statistics of rows[0..n) that choose their integer layout (layouts.integer_layout_of):
   stats[0] = 1 where a scale or minimum is no float16 value, stats[1] and stats[2] the least and
   largest code. AGENTSPEC_BAD_ARGUMENT for a type or count this does not read, else 0. */
int agentspec_gguf_statistics(const uint8_t *const *rows, const int *types, int n, int K, int threads, int stats[3]) {
    if (!gguf_known(rows, types, n, K, threads) || !stats) return AGENTSPEC_BAD_ARGUMENT;
    const int blocks = K / 32;
    int factored = 0, low = INT32_MAX, high = INT32_MIN;
#pragma omp parallel for num_threads(threads) reduction(| : factored) reduction(min : low) reduction(max : high) schedule(static)
    for (int i = 0; i < n; i++) {
        gguf_block block;
        for (int b = 0; b < blocks; b++) gguf_read_block(rows[i], types[i], b, &block), block_statistics(&block, types[i], &factored, &low, &high);
    }
    stats[0] = factored, stats[1] = low, stats[2] = high;
    return 0;
}

/* Lane o's codes of a block in its registers (register r: 4 bytes at r LANES + o; CODES constant
   where this is inlined): bytes, or 4-bit codes two to a byte (byte j: codes j and j + 16), then the
   fifth bits (byte i, bit j: code 4j + i's) and the sixth. Four bytes at a time: word j is codes
   4j .. 4j + 3, byte i of each at bits 8i. */
static inline __attribute__((always_inline)) void lane_codes(const uint8_t u[32], const int codes, uint8_t *at, int o) {
    uint32_t word[8], out;
    memcpy(word, u, 32);
    for (int r = 0; r < (codes == 0 ? 8 : 4); r++) {
        out = codes == 0 ? word[r] : (word[r] & 0x0f0f0f0fu) | (word[4 + r] & 0x0f0f0f0fu) << 4;
        memcpy(at + ((size_t)r * LANES + o) * 4, &out, 4);
    }
    for (int bit = 4; bit < 3 + codes; bit++) {
        out = 0;
        for (int j = 0; j < 8; j++) out |= ((word[j] >> bit) & 0x01010101u) << j; /* byte i, bit j: word j's byte i's bit */
        memcpy(at + ((size_t)bit * LANES + o) * 4, &out, 4);
    }
}

/* The least and largest code seen at each of a block's 32 places (signed: the codes less their
   offset, all within a byte), over the blocks of a group: the fast paths below keep them without a
   horizontal reduction a block; code_extremes_into reduces them once a group. */
typedef struct {
    int8_t least[32], most[32];
    int seen;
} code_extremes;

static inline void code_extremes_start(code_extremes *e) {
    memset(e->least, 127, 32), memset(e->most, 128, 32), e->seen = 0;
}

static inline void code_range(const uint8_t u[32], int offset, code_extremes *e) {
    for (int j = 0; j < 32; j++) {
        const int8_t c = (int8_t)(u[j] - offset);
        e->least[j] = c < e->least[j] ? c : e->least[j], e->most[j] = c > e->most[j] ? c : e->most[j];
    }
    e->seen = 1;
}

static inline void code_extremes_into(const code_extremes *e, int *low, int *high) {
    if (!e->seen) return;
    for (int j = 0; j < 32; j++) *low = e->least[j] < *low ? e->least[j] : *low, *high = e->most[j] > *high ? e->most[j] : *high;
}

/* Bits 0..7 of `eight` as bit `bit` of bytes 0..7. */
static inline uint64_t bits_to_bytes(uint32_t eight, int bit) {
#if defined(__BMI2__)
    return _pdep_u64(eight, 0x0101010101010101ull << bit);
#else
    uint64_t out = 0;
    for (int i = 0; i < 8; i++) out |= (uint64_t)((eight >> i) & 1) << (8 * i + bit);
    return out;
#endif
}

/* Bit `bit` of each of the 32 bytes `u` as bits 0..31. */
static inline uint32_t byte_bits(const uint8_t u[32], int bit) {
    uint64_t w[4];
    uint32_t out = 0;
    memcpy(w, u, 32);
    for (int h = 0; h < 4; h++) {
#if defined(__BMI2__)
        out |= (uint32_t)_pext_u64(w[h], 0x0101010101010101ull << bit) << (8 * h);
#else
        for (int i = 0; i < 8; i++) out |= (uint32_t)((w[h] >> (8 * i + bit)) & 1) << (8 * h + i);
#endif
    }
    return out;
}

/* Bits i, i + 4, ..., i + 28 of `x` as bits 0..7. */
static inline uint32_t every_fourth_bit(uint32_t x, int i) {
    uint32_t t = (x >> i) & 0x11111111u;
    t = (t | t >> 3) & 0x03030303u;
    t = (t | t >> 6) & 0x000F000Fu;
    return (t | t >> 12) & 0xFFu;
}

#define LOW_NIBBLES 0x0F0F0F0F0F0F0F0Full

/* The 4-bit registers of a block whose code j is byte j of `codes` (0..15), for lane o: register r's
   byte i holds codes 4r + i (low nibble) and 16 + 4r + i (high nibble). */
static inline void nibble_registers(const uint64_t codes[4], uint8_t *at, int o) {
    for (int r = 0; r < 4; r++) {
        uint32_t first, second, out;
        memcpy(&first, (const uint8_t *)codes + 4 * r, 4), memcpy(&second, (const uint8_t *)codes + 16 + 4 * r, 4);
        out = first | second << 4;
        memcpy(at + ((size_t)r * LANES + o) * 4, &out, 4);
    }
}

/* A register of one bit of each code, for lane o (register `index`) from `bits` (bit t: code t's):
   byte i, bit j holds code 4j + i's. */
static inline void bit_register(uint32_t bits, uint8_t *at, int index, int o) {
    uint32_t out = 0;
    for (int i = 0; i < 4; i++) out |= every_fourth_bit(bits, i) << (8 * i);
    memcpy(at + ((size_t)index * LANES + o) * 4, &out, 4);
}

/* The two layouts most of a Q4_K_M file takes, written straight from the file's bytes: the same
   bytes (and statistics) as gguf_read_block and lane_codes give, without unpacking code by code.
   A Q5_0 block in 5-bit codes (offset 16: the file's 5-bit values): its 4-bit registers are the
   file's nibble bytes as they are, its fifth-bit register a shuffle of the file's high bits. */
static inline void q5_0_lanes(const uint8_t *p, uint8_t *at, uint8_t *values, int o, code_extremes *stats, int *factored) {
    uint32_t qh;
    uint16_t bits;
    memcpy(&qh, p + 2, 4);
    for (int r = 0; r < 4; r++) memcpy(at + ((size_t)r * LANES + o) * 4, p + 6 + 4 * r, 4);
    bit_register(qh, at, 4, o);
    const int exact = half_bits(half_value(p), &bits);
    memcpy(values + (size_t)o * 2, &bits, 2);
    if (stats) { /* codes 0..15: the low nibbles, 16..31 the high ones, each with its fifth bit */
        uint64_t q[2], u[4];
        memcpy(q, p + 6, 16);
        for (int h = 0; h < 2; h++) {
            u[h] = (q[h] & LOW_NIBBLES) | bits_to_bytes((qh >> (8 * h)) & 255, 4);
            u[2 + h] = ((q[h] >> 4) & LOW_NIBBLES) | bits_to_bytes((qh >> (16 + 8 * h)) & 255, 4);
        }
        code_range((const uint8_t *)u, 16, stats);
        *factored |= !exact;
    }
}

/* Block s of a Q4_K super-block `p` in 4-bit codes with minimums, factored (the 6-bit factors, and
   the super-block's d and -dmin in `super` before its first block) or not (each block's scale and
   minimum as float16): each register's bytes the block's nibbles (the low or high halves of the
   file's 32 bytes of them), re-paired. */
static inline void q4_k_lanes(const uint8_t *p, int s, int factored_layout, uint8_t *at, uint8_t *values, uint8_t *super, int o, code_extremes *stats,
                              int *factored) {
    const uint8_t *q = p + 16 + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    uint64_t w[4];
    memcpy(w, q, 32);
    for (int h = 0; h < 4; h++) w[h] = (w[h] >> shift) & LOW_NIBBLES; /* code j at byte j */
    nibble_registers(w, at, o);
    int scale, min;
    uint16_t bits;
    k_scale_min(p + 4, s, &scale, &min);
    const float d = half_value(p), dmin = half_value(p + 2), block_scale = d * (float)scale, block_min = -(dmin * (float)min);
    int exact;
    if (factored_layout) {
        values[o] = (uint8_t)scale, values[(size_t)LANES + o] = (uint8_t)min;
        if (super) half_bits(d, &bits), memcpy(super + (size_t)o * 2, &bits, 2), half_bits(-dmin, &bits), memcpy(super + ((size_t)LANES + o) * 2, &bits, 2);
        exact = *factored || !stats || (half_bits(block_scale, &bits) && half_bits(block_min, &bits)); /* looked at only where needed */
    } else {
        exact = half_bits(block_scale, &bits), memcpy(values + (size_t)o * 2, &bits, 2);
        exact = half_bits(block_min, &bits) && exact, memcpy(values + ((size_t)LANES + o) * 2, &bits, 2);
    }
    if (stats) {
        code_range((const uint8_t *)w, 0, stats);
        *factored |= !exact;
    }
}

/* Block s of a Q6_K super-block `p` in factored 6-bit codes with a scale per half (offset 32: the
   file's 6-bit values; Q6_K's layout is always factored): the 4-bit registers re-paired from its
   low nibbles, the fifth- and sixth-bit registers shuffled from its 2-bit highs, each half's factor,
   and the super-block's d in `super` before its first block. */
static inline void q6_k_lanes(const uint8_t *p, int s, uint8_t *at, uint8_t *values, uint8_t *super, int o, code_extremes *stats) {
    const int n = s / 4, shift = 4 * ((s / 2) % 2), k = s % 4;
    const uint8_t *low = p + 64 * n + 32 * (s % 2), *upper = p + 128 + 32 * n;
    uint64_t w[4], h[4];
    memcpy(w, low, 32), memcpy(h, upper, 32);
    for (int i = 0; i < 4; i++) w[i] = (w[i] >> shift) & LOW_NIBBLES, h[i] = (h[i] >> (2 * k)) & 0x0303030303030303ull; /* byte j: code j's */
    nibble_registers(w, at, o);
    for (int bit = 0; bit < 2; bit++) bit_register(byte_bits((const uint8_t *)h, bit), at, 4 + bit, o); /* the fifth and sixth bits */
    for (int half = 0; half < 2; half++) values[(size_t)half * LANES + o] = p[192 + 2 * s + half];
    if (super) {
        uint16_t bits;
        half_bits(half_value(p + 208), &bits), memcpy(super + (size_t)o * 2, &bits, 2);
    }
    if (stats) {
        for (int i = 0; i < 4; i++) w[i] |= h[i] << 4;
        code_range((const uint8_t *)w, 32, stats);
    }
}

/* rows[0..n) as Blocks.by_lanes(LANES, layout) lays them out (codes: 0 bytes, 1 4-bit, 2 5-bit,
   3 6-bit; mins, factored, halves: IntegerLayout's), n padded to a multiple of LANES with zeros:
   [ceil(n / LANES), bytes a group] into `out`; and, where `stats` is not NULL, their statistics
   (agentspec_gguf_statistics: a run laid out in the layout of the runs before it says on the way
   whether it needs a wider one). A group's blocks are written in turn, each from its
   LANES rows, so what is written stays in the cache. AGENTSPEC_BAD_ARGUMENT where this does not read
   a type or count, else 0. */
int agentspec_gguf_by_lanes(const uint8_t *const *rows, const int *types, int n, int K, int codes, int mins, int factored, int halves, int threads,
                            uint8_t *out, int *stats) {
    if (!gguf_known(rows, types, n, K, threads) || codes < 0 || codes > 3 || (mins | factored | halves) & ~1 || !out) return AGENTSPEC_BAD_ARGUMENT;
    const int blocks = K / 32, groups = (n + LANES - 1) / LANES, registers = codes == 0 ? 8 : 3 + codes;
    const int offset = mins ? 0 : (int[]){128, 8, 16, 32}[codes], scales = halves ? 2 : 1;
    const size_t code_bytes = (size_t)registers * 4 * LANES;
    const size_t block_bytes = factored ? code_bytes + (size_t)(scales + mins) * LANES : code_bytes + (size_t)(scales + mins) * 2 * LANES;
    const size_t super_bytes = factored ? (size_t)(1 + mins) * 2 * LANES : 0, supers = factored ? (size_t)(blocks + 7) / 8 : 0;
    const size_t group_bytes = supers * super_bytes + (size_t)blocks * block_bytes;
    int found_factored = 0, low = INT32_MAX, high = INT32_MIN;
#pragma omp parallel for num_threads(threads) reduction(| : found_factored) reduction(min : low) reduction(max : high) schedule(static)
    for (int g = 0; g < groups; g++) {
        const int lanes = n - g * LANES < LANES ? n - g * LANES : LANES; /* the last group's others are zeros */
        uint8_t *group = out + g * group_bytes;
        memset(group, 0, group_bytes);
        code_extremes seen; /* the fast paths' codes */
        code_extremes_start(&seen);
        for (int b = 0; b < blocks; b++) {
            /* a group: per super-block of 8 blocks (factored), its values, then its blocks */
            uint8_t *at = group + (factored ? (size_t)(b / 8 + 1) * super_bytes : 0) + (size_t)b * block_bytes, *values = at + code_bytes;
            for (int o = 0; o < lanes; o++) {
                const int type = types[g * LANES + o];
                if (type == GGML_Q5_0 && codes == CODES_5BIT && !mins && !factored && !halves) {
                    q5_0_lanes(rows[g * LANES + o] + (size_t)b * 22, at, values, o, stats ? &seen : NULL, &found_factored);
                    continue;
                }
                if (type == GGML_Q4_K && codes == CODES_4BIT && mins && !halves) {
                    q4_k_lanes(rows[g * LANES + o] + (size_t)(b / 8) * 144, b % 8, factored, at, values, factored && b % 8 == 0 ? at - super_bytes : NULL, o,
                               stats ? &seen : NULL, &found_factored);
                    continue;
                }
                if (type == GGML_Q6_K && codes == CODES_6BIT && !mins && factored && halves) {
                    q6_k_lanes(rows[g * LANES + o] + (size_t)(b / 8) * 210, b % 8, at, values, b % 8 == 0 ? at - super_bytes : NULL, o, stats ? &seen : NULL);
                    continue;
                }
                gguf_block block;
                uint16_t bits;
                gguf_read_block(rows[g * LANES + o], type, b, &block);
                if (stats) block_statistics(&block, type, &found_factored, &low, &high);
                if (factored && b % 8 == 0)
                    for (int k = 0; k < 1 + mins; k++) half_bits(block.super[k], &bits), memcpy(at - super_bytes + ((size_t)k * LANES + o) * 2, &bits, 2);
                uint8_t u[32]; /* unsigned codes: offset where there is no minimum (wrapping as a byte) */
                for (int j = 0; j < 32; j++) u[j] = (uint8_t)(block.code[j] + offset);
                switch (codes) { /* constants inside */
                case 0: lane_codes(u, 0, at, o); break;
                case 1: lane_codes(u, 1, at, o); break;
                case 2: lane_codes(u, 2, at, o); break;
                default: lane_codes(u, 3, at, o); break;
                }
                if (factored) {
                    for (int k = 0; k < scales + mins; k++) values[(size_t)k * LANES + o] = (uint8_t)block.factor[k];
                } else {
                    for (int k = 0; k < scales; k++) half_bits(block.scale[k], &bits), memcpy(values + ((size_t)k * LANES + o) * 2, &bits, 2);
                    if (mins) half_bits(block.min, &bits), memcpy(values + ((size_t)scales * LANES + o) * 2, &bits, 2);
                }
            }
        }
        code_extremes_into(&seen, &low, &high);
    }
    if (stats) stats[0] = found_factored, stats[1] = low, stats[2] = high;
    return 0;
}
