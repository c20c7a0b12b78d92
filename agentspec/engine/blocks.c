/* Products on a GGUF file's own weight blocks, for agentspec's target pass (blocks.py).

   y[r, n] = sum_k x[r, k] * w[n, k] for float32 rows x, with w read from its blocks of 32 weights:
     Q4_1: w = d * q + m, q a 4-bit code (qs: 16 bytes per block; byte j holds codes j and j + 16)
     Q8_0: w = d * q, q a signed byte (qs: 32 bytes per block)
   d and m are the blocks' scales and minimums as float32. Each w is rounded exactly as the GGUF
   reader dequantises it (a product, then a sum; -ffp-contract=off keeps them apart), so these are
   the loaded model's float32 weights, read in a fifth (Q4_1) or a quarter (Q8_0) of the bytes.

   Row-invariant by construction: each (row, output) pair is one 16-lane accumulator that takes the
   same fused multiply-adds in the same order, then one fixed horizontal sum, however many rows and
   outputs are computed beside it and whichever thread computes it. So a row's result does not
   depend on how many positions or sequences share its pass. */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#ifndef __AVX512F__
#error "the GGUF block kernels need AVX-512 (AVX512F)"
#endif

#define NT 2 /* outputs per tile: each block's weights are dequantised once for up to MR rows */
#define MR 8 /* rows per tile */

#define UNROLL _Pragma("GCC unroll 16")

/* One tile: outputs n .. n + nt - 1 for `rows` rows (a compile-time constant at every call site,
   so the row loop unrolls). The macro's argument dequantises block b of output n + t into w0[t]
   (its weights 0..15) and w1[t] (16..31). */
#define TILE_BODY(...)                                                                              \
    const int nb = K / 32;                                                                         \
    __m512 acc[NT][MR];                                                                            \
    UNROLL for (int t = 0; t < NT; t++) UNROLL for (int r = 0; r < MR; r++) acc[t][r] = _mm512_setzero_ps(); \
    for (int b = 0; b < nb; b++) {                                                                 \
        __m512 w0[NT], w1[NT];                                                                     \
        UNROLL for (int t = 0; t < NT; t++) {                                                      \
            const size_t i = (size_t)(n + (t < nt ? t : 0)) * nb + b;                              \
            __VA_ARGS__                                                                            \
        }                                                                                          \
        UNROLL for (int r = 0; r < MR; r++) {                                                      \
            if (r < rows) {                                                                        \
                const float *xr = x + (size_t)r * K + (size_t)b * 32;                              \
                const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);              \
                UNROLL for (int t = 0; t < NT; t++) {                                              \
                    acc[t][r] = _mm512_fmadd_ps(x0, w0[t], acc[t][r]);                             \
                    acc[t][r] = _mm512_fmadd_ps(x1, w1[t], acc[t][r]);                             \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    UNROLL for (int t = 0; t < NT; t++) UNROLL for (int r = 0; r < MR; r++)                        \
        if (t < nt && r < rows) y[(size_t)r * N + n + t] = _mm512_reduce_add_ps(acc[t][r]);

static inline __attribute__((always_inline)) void q4_1_tile(const float *x, const int rows, int K, const uint8_t *qs,
                                                            const float *d, const float *m, float *y, int N, int n, int nt) {
    const __m512i low = _mm512_set1_epi32(15);
    TILE_BODY(
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + i * 16)));
        const __m512 scale = _mm512_set1_ps(d[i]), min = _mm512_set1_ps(m[i]);
        w0[t] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(codes, low)), scale), min);
        w1[t] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)), scale), min);
    )
}

static inline __attribute__((always_inline)) void q8_0_tile(const float *x, const int rows, int K, const int8_t *qs,
                                                            const float *d, const float *m, float *y, int N, int n, int nt) {
    (void)m;
    TILE_BODY(
        const __m512 scale = _mm512_set1_ps(d[i]);
        w0[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + i * 32)))), scale);
        w1[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + i * 32 + 16)))), scale);
    )
}

/* Outputs split over `threads` (static: a thread's share depends only on N); rows in tiles of MR. */
#define PRODUCT(TILE, CODE)                                                                        \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
    for (int n = 0; n < N; n += NT) {                                                              \
        const int nt = N - n < NT ? N - n : NT;                                                    \
        for (int r0 = 0; r0 < M; r0 += MR) {                                                       \
            const float *xr = x + (size_t)r0 * K;                                                  \
            float *yr = y + (size_t)r0 * N;                                                        \
            const CODE *q = (const CODE *)qs;                                                      \
            switch (M - r0 < MR ? M - r0 : MR) {                                                   \
            case 1: TILE(xr, 1, K, q, d, m, yr, N, n, nt); break;                                  \
            case 2: TILE(xr, 2, K, q, d, m, yr, N, n, nt); break;                                  \
            case 3: TILE(xr, 3, K, q, d, m, yr, N, n, nt); break;                                  \
            case 4: TILE(xr, 4, K, q, d, m, yr, N, n, nt); break;                                  \
            case 5: TILE(xr, 5, K, q, d, m, yr, N, n, nt); break;                                  \
            case 6: TILE(xr, 6, K, q, d, m, yr, N, n, nt); break;                                  \
            case 7: TILE(xr, 7, K, q, d, m, yr, N, n, nt); break;                                  \
            default: TILE(xr, 8, K, q, d, m, yr, N, n, nt); break;                                 \
            }                                                                                      \
        }                                                                                          \
    }

void agentspec_q4_1_product(const float *x, int M, int K, const void *qs, const float *d, const float *m, float *y, int N, int threads) {
    PRODUCT(q4_1_tile, uint8_t)
}

void agentspec_q8_0_product(const float *x, int M, int K, const void *qs, const float *d, const float *m, float *y, int N, int threads) {
    PRODUCT(q8_0_tile, int8_t)
}
