/* Products on a GGUF file's own weight blocks, for agentspec's target pass (blocks.py).

   y[r, n] = sum_k x[r, k] * w[n, k] for float32 rows x, with w read from its blocks of 32 weights:
     Q4_1: w = d * q + m, q a 4-bit code (16 bytes per block; byte j holds codes j and j + 16)
     Q8_0: w = d * q, q a signed byte (32 bytes per block)
   d and m are the blocks' scales and minimums as float32. Each w is rounded exactly as the GGUF
   reader dequantises it (a product, then a sum; -ffp-contract=off keeps them apart), so these are
   the loaded model's float32 weights, read in a fifth (Q4_1) or a quarter (Q8_0) of the bytes.

   Layout (Blocks.grouped in blocks.py): outputs in groups of GROUP; for each group, its blocks in
   input order, each the GROUP outputs' codes, then their GROUP scales (and minimums): one stream of
   memory per group, read front to back and prefetched a few blocks ahead. (With codes, scales and
   minimums in three arrays, a 1-row product read three streams per output and reached 16 GB/s;
   grouped, 31 GB/s, about what two cores stream here.)

   Row-invariant by construction: each (row, output) pair is one 16-lane accumulator that takes the
   same fused multiply-adds in the same order, then one fixed horizontal sum, however many rows and
   outputs are computed beside it and whichever thread computes it. So a row's result does not
   depend on how many positions or sequences share its pass. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef __AVX512F__
#error "the GGUF block kernels need AVX-512 (AVX512F)"
#endif

#define MR 8    /* rows per tile, at most */
#define MAXC 8  /* outputs per tile, at most: 8 for one or two rows, down to 2 for 5-8 rows (registers) */
#define FEW 8   /* outputs grouped together in the layout read by products of 1-2 rows */
#define MANY 4  /* ... and in the layout read by products of more rows */
#define Q4_1_BYTES(G) ((G) * (16 + 8)) /* one block of a group of G outputs: codes, scales, minimums */
#define Q8_0_BYTES(G) ((G) * (32 + 4)) /* codes, scales */
#define AHEAD 4 /* blocks prefetched ahead by products of 1-2 rows (bound by bytes, not arithmetic) */
#define UNROLL _Pragma("GCC unroll 16")
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

/* How many outputs a tile of `rows` rows takes: enough independent accumulators to hide the
   latency of the multiply-adds, few enough to stay in the 32 vector registers, and a multiple of
   its layout's group. It does not change any (row, output) pair's arithmetic. */
static inline __attribute__((always_inline)) int tile_outputs(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }
static inline __attribute__((always_inline)) int group_of(int rows) { return rows <= 2 ? FEW : MANY; }

/* One tile: outputs n .. n + nt - 1 for `rows` rows (compile-time constants at every call site, so
   the loops unroll and the accumulators live in registers), reading the layout grouped by G. The
   macro's argument dequantises the block at `at` (lane `lane` of its group) into w0[t] (weights
   0..15) and w1[t] (16..31). */
#define TILE_BODY(BYTES, ...)                                                                       \
    const int nb = K / 32, cols = tile_outputs(rows), G = group_of(rows);                          \
    __m512 acc[MAXC][MR];                                                                          \
    UNROLL for (int t = 0; t < MAXC; t++) UNROLL for (int r = 0; r < MR; r++) acc[t][r] = _mm512_setzero_ps(); \
    for (int b = 0; b < nb; b++) {                                                                 \
        __m512 w0[MAXC], w1[MAXC];                                                                 \
        UNROLL for (int t = 0; t < MAXC; t++) {                                                    \
            if (t < cols) {                                                                        \
                const int o = n + (t < nt ? t : 0), lane = o % G;                                  \
                const uint8_t *at = (G == FEW ? few : many) + ((size_t)(o / G) * nb + b) * (BYTES); \
                if (rows <= 2 && t % G == 0)                                                       \
                    for (int line = 0; line < (BYTES); line += 64) _mm_prefetch((const char *)(at + AHEAD * (BYTES) + line), _MM_HINT_T0); \
                __VA_ARGS__                                                                        \
            }                                                                                      \
        }                                                                                          \
        UNROLL for (int r = 0; r < MR; r++) {                                                      \
            if (r < rows) {                                                                        \
                const float *xr = x + (size_t)r * K + (size_t)b * 32;                              \
                const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);              \
                UNROLL for (int t = 0; t < MAXC; t++) {                                            \
                    if (t < cols) {                                                                \
                        acc[t][r] = _mm512_fmadd_ps(x0, w0[t], acc[t][r]);                         \
                        acc[t][r] = _mm512_fmadd_ps(x1, w1[t], acc[t][r]);                         \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    UNROLL for (int t = 0; t < MAXC; t++) UNROLL for (int r = 0; r < MR; r++)                      \
        if (t < cols && t < nt && r < rows) y[(size_t)r * N + n + t] = _mm512_reduce_add_ps(acc[t][r]);

/* Q4_1 through a table: the block's 16 possible weights d * q + m (q = 0..15, rounded as the GGUF
   reader rounds them) fill one register, and each code picks its weight (vpermps reads an index's
   low 4 bits, so the low nibble needs no mask). */
static inline __attribute__((always_inline)) void q4_1_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many,
                                                            float *y, int N, int n, int nt) {
    const __m512 codes16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    TILE_BODY(Q4_1_BYTES(G),
        const float d = ((const float *)(at + G * 16))[lane], m = ((const float *)(at + G * 20))[lane];
        const __m512 table = _mm512_add_ps(_mm512_mul_ps(codes16, _mm512_set1_ps(d)), _mm512_set1_ps(m));
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + lane * 16)));
        w0[t] = _mm512_permutexvar_ps(codes, table);
        w1[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    )
}

static inline __attribute__((always_inline)) void q8_0_tile(const float *x, const int rows, int K, const uint8_t *few, const uint8_t *many,
                                                            float *y, int N, int n, int nt) {
    TILE_BODY(Q8_0_BYTES(G),
        const __m512 scale = _mm512_set1_ps(((const float *)(at + G * 32))[lane]);
        const int8_t *codes = (const int8_t *)(at + lane * 32);
        w0[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes))), scale);
        w1[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)))), scale);
    )
}

/* Rows in chunks of MR; a chunk's outputs in tiles split over `threads` (static: a thread's share
   depends only on N and the chunk). */
#define CHUNK(TILE, ROWS)                                                                          \
    {                                                                                              \
        const int cols = tile_outputs(ROWS);                                                       \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int n = 0; n < N; n += cols)                                                          \
            TILE(xr, ROWS, K, (const uint8_t *)few, (const uint8_t *)many, yr, N, n, N - n < cols ? N - n : cols); \
    }

#define PRODUCT(TILE)                                                                              \
    for (int r0 = 0; r0 < M; r0 += MR) {                                                           \
        const float *xr = x + (size_t)r0 * K;                                                      \
        float *yr = y + (size_t)r0 * N;                                                            \
        BY_COUNT(M - r0, CHUNK, TILE)                                                              \
    }

/* few, many: the blocks grouped by FEW and by MANY outputs (Blocks.grouped in blocks.py). */
void agentspec_q4_1_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    PRODUCT(q4_1_tile)
}

void agentspec_q8_0_product(const float *x, int M, int K, const void *few, const void *many, float *y, int N, int threads) {
    PRODUCT(q8_0_tile)
}

/* ---- Products on 8- and 16-bit activations (weights="gguf-q8", "gguf-q16") -----------------------
   llama.cpp's arithmetic for these blocks: each row is quantised per block of 32 inputs to signed
   bytes a with one float scale (d_a = max|x| / 127, a = round(x / d_a)), and a block's product is an
   exact integer dot product of codes, scaled:
     Q4_1: sum_k w x ~ d_w d_a sum(q a) + m_w (d_a sum(a))
     Q8_0: sum_k w x ~ d_w d_a sum(q a)
   The weights are the file's, unchanged; only the activations are rounded (to 1/254 of a block's
   largest magnitude), so these are another model's products than the float32 kernels above: opt in.
   With two planes (weights="gguf-q16") the rows are rounded to 16 bits (1/65278 of a block's largest
   magnitude) and split exactly into two bytes each; a block takes two integer dot products.
   VNNI's vpdpbusd multiplies 64 unsigned by signed bytes into 16 sums per instruction, four times the
   multiply-adds of a 512-bit float FMA, so products of several rows cost little more than one.

   Layout (Blocks.vnni in blocks.py): outputs in groups of 16, one 32-bit lane each; per group, its
   blocks in input order. A Q4_1 block: 4 x 64 bytes of codes (register j, lane o: the byte holding
   codes 4j..4j+3 of output o in its low nibbles, 16+4j.. in its high ones, as the file packs them),
   then the 16 scales and 16 minimums as float16 (exactly the file's). A Q8_0 block: 8 x 64 bytes of
   codes + 128 (unsigned; the dot product subtracts 128 sum(a), exactly), then 16 float16 scales.

   Row-invariant by construction: a row's quantisation reads only the row; each (row, output) pair is
   one lane taking the same integer dot products and float multiply-adds in the same order (no
   horizontal sum), whatever else shares the call and whichever thread computes it.

   Built where the compiler targets AVX512-VNNI and AVX512-BW (agentspec_vnni says whether). */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
const int agentspec_vnni = 1;

#define LANES 16
#define Q4_1_VNNI_BYTES (LANES * 16 + LANES * 4) /* codes, float16 scales and minimums */
#define Q8_0_VNNI_BYTES (LANES * 32 + LANES * 2) /* codes + 128, float16 scales */
#define ROWS8 8                                  /* rows per tile, at most */

/* Row r, block b: its `planes` planes of 32 signed bytes at codes + ((r * nb + b) * planes + plane) * 32;
   its scale d, d * sum(a) and sum(a). */
typedef struct {
    int8_t *codes;
    float *scale, *scaled_sum;
    int32_t *sum;
} agentspec_q8_rows;

/* One plane: a = round(x / d), d = max|x| / 127. Two planes: a = round(x / d), d = max|x| / 32639,
   as 256 * high + low with high = floor((a + 128) / 256) and low = a - 256 * high, both in
   [-128, 127]: a dot product with them is 256 * (the high plane's) + (the low plane's), exactly. */
static void quantise_rows(const float *x, int M, int K, const int planes, agentspec_q8_rows *q) {
    const int nb = K / 32;
    const float top_code = planes == 1 ? 127.0f : 32639.0f;
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float d = top / top_code, inverse = top > 0.0f ? top_code / top : 0.0f;
            /* round to nearest, ties to even (the default rounding mode) */
            const __m512i a0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
            const __m512i a1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
            const size_t at = (size_t)r * nb + b;
            int8_t *codes = q->codes + at * 32 * planes;
            if (planes == 1) {
                _mm_storeu_si128((__m128i *)codes, _mm512_cvtsepi32_epi8(a0));
                _mm_storeu_si128((__m128i *)(codes + 16), _mm512_cvtsepi32_epi8(a1));
            } else {
                const __m512i h0 = _mm512_srai_epi32(_mm512_add_epi32(a0, _mm512_set1_epi32(128)), 8);
                const __m512i h1 = _mm512_srai_epi32(_mm512_add_epi32(a1, _mm512_set1_epi32(128)), 8);
                _mm_storeu_si128((__m128i *)codes, _mm512_cvtepi32_epi8(h0));
                _mm_storeu_si128((__m128i *)(codes + 16), _mm512_cvtepi32_epi8(h1));
                _mm_storeu_si128((__m128i *)(codes + 32), _mm512_cvtepi32_epi8(_mm512_sub_epi32(a0, _mm512_slli_epi32(h0, 8))));
                _mm_storeu_si128((__m128i *)(codes + 48), _mm512_cvtepi32_epi8(_mm512_sub_epi32(a1, _mm512_slli_epi32(h1, 8))));
            }
            q->sum[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
            q->scale[at] = d;
            q->scaled_sum[at] = d * (float)q->sum[at];
        }
}

/* One tile: the 16 outputs of group g for `rows` rows on activations in `planes` planes (compile-time
   constants at every call site). A block's dot product of a row: the high plane's, times 256, plus
   the low plane's (one plane: its two halves), in 32-bit integers (|sum| < 2^29), so exact whatever
   the order. Two independent chains of vpdpbusd instead of one per row: 8 rows' products took 4.5
   against 7.0 ms (8-bit; 16-bit 6.4 against 9.2) for the default model's 120 layer products. */
static inline __attribute__((always_inline)) void vnni_tile(const int q8_0, const int planes, const agentspec_q8_rows *q, const int rows, int K,
                                                           const uint8_t *w, float *y, int N, int g) {
    const int nb = K / 32, bytes = q8_0 ? Q8_0_VNNI_BYTES : Q4_1_VNNI_BYTES, codes = q8_0 ? LANES * 32 : LANES * 16;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[ROWS8];
    UNROLL for (int r = 0; r < ROWS8; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *at = w + ((size_t)g * nb + b) * bytes;
        for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)(at + AHEAD * bytes + line), _MM_HINT_T0);
        __m512i v[8]; /* registers j of the block: Q8_0, 4 codes + 128 per lane; Q4_1, codes 4j.. (v[j]) and 16+4j.. (v[4 + j]) */
        if (q8_0) {
            UNROLL for (int j = 0; j < 8; j++) v[j] = _mm512_loadu_si512(at + 64 * j);
        } else {
            UNROLL for (int j = 0; j < 4; j++) {
                const __m512i both = _mm512_loadu_si512(at + 64 * j);
                v[j] = _mm512_and_si512(both, nibble);
                v[4 + j] = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
            }
        }
        __m512i dot[ROWS8];
        UNROLL for (int r = 0; r < ROWS8; r++) {
            if (r < rows) {
                const int32_t *a = (const int32_t *)(q->codes + ((size_t)r * nb + b) * 32 * planes);
                __m512i part[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}; /* two chains of dot products: each plane's, or halves of one */
                UNROLL for (int j = 0; j < 8 * planes; j++) {
                    const int chain = planes == 2 ? j / 8 : j % 2;
                    part[chain] = _mm512_dpbusd_epi32(part[chain], v[j % 8], _mm512_set1_epi32(a[j]));
                }
                dot[r] = _mm512_add_epi32(planes == 2 ? _mm512_slli_epi32(part[0], 8) : part[0], part[1]);
                if (q8_0) dot[r] = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * q->sum[(size_t)r * nb + b]));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + codes)));
        const __m512 m = q8_0 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(at + codes + 32)));
        UNROLL for (int r = 0; r < ROWS8; r++) {
            if (r < rows) {
                const size_t rb = (size_t)r * nb + b;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(q->scale[rb])), acc[r]);
                if (!q8_0) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(q->scaled_sum[rb]), acc[r]);
            }
        }
    }
    const int live = N - g * LANES < LANES ? N - g * LANES : LANES;
    UNROLL for (int r = 0; r < ROWS8; r++)
        if (r < rows) _mm512_mask_storeu_ps(y + (size_t)r * N + (size_t)g * LANES, (__mmask16)((1u << live) - 1), acc[r]);
}

#define VNNI_CHUNK(Q8_0, PLANES, ROWS)                                                             \
    {                                                                                              \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                          \
        for (int g = 0; g < groups; g++) vnni_tile(Q8_0, PLANES, &part, ROWS, K, (const uint8_t *)w, y + (size_t)r0 * N, N, g); \
    }

#define VNNI_PRODUCT(Q8_0, PLANES)                                                                 \
    const int nb = K / 32, groups = (N + LANES - 1) / LANES;                                      \
    agentspec_q8_rows q = {malloc((size_t)M * K * PLANES), malloc(sizeof(float) * M * nb), malloc(sizeof(float) * M * nb), malloc(sizeof(int32_t) * M * nb)}; \
    quantise_rows(x, M, K, PLANES, &q);                                                            \
    for (int r0 = 0; r0 < M; r0 += ROWS8) {                                                        \
        const size_t at = (size_t)r0 * nb;                                                         \
        const agentspec_q8_rows part = {q.codes + at * 32 * PLANES, q.scale + at, q.scaled_sum + at, q.sum + at}; \
        BY_COUNT(M - r0, VNNI_CHUNK, Q8_0, PLANES)                                                 \
    }                                                                                              \
    free(q.codes); free(q.scale); free(q.scaled_sum); free(q.sum);

/* w: the blocks as Blocks.vnni lays them out. */
void agentspec_q4_1_q8_product(const float *x, int M, int K, const void *w, float *y, int N, int threads) { VNNI_PRODUCT(0, 1) }

void agentspec_q8_0_q8_product(const float *x, int M, int K, const void *w, float *y, int N, int threads) { VNNI_PRODUCT(1, 1) }

void agentspec_q4_1_q16_product(const float *x, int M, int K, const void *w, float *y, int N, int threads) { VNNI_PRODUCT(0, 2) }

void agentspec_q8_0_q16_product(const float *x, int M, int K, const void *w, float *y, int N, int threads) { VNNI_PRODUCT(1, 2) }
#else
const int agentspec_vnni = 0;
#endif

/* ---- The decoder layers of a Llama model in one call ------------------------------------------
   Everything between the embedding and the final norm: per layer RMSNorm, the q/k/v product, the
   rotary embedding, the new keys and values written to each sequence's block, causal attention of
   each sequence over its own block, the output product and residual, RMSNorm, the gate/up product,
   SiLU times up, the down product and residual. The same operations in the same order as the fused
   pass in Python (fused.py), without ~120 framework calls per pass. Each token's arithmetic
   depends only on its own row and its sequence's keys and values: row-invariant, like the products. */

typedef struct {
    int kind;               /* 0: Q4_1, 1: Q8_0, on float32 rows; 2, 3: on 8-bit rows; 4, 5: on 16-bit rows */
    const void *few, *many; /* float32 rows: the blocks grouped for products of few and of many rows; 8-bit rows: few, laid out for VNNI */
} agentspec_blocks;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    agentspec_blocks qkv, o, gate_up, down;
} agentspec_layer;

typedef struct {
    int start, stop, past, capacity; /* the sequence's new tokens [start, stop) of the pass */
    void *kv;                        /* its block: [layers, 2, kv_heads, capacity, head_dim], float32 or float16 */
} agentspec_segment;

/* 16 keys' (values') elements from a block of float32 or, with `half` (a compile-time constant at
   each call site), float16 — converted exactly to float32. */
static inline __attribute__((always_inline)) __m512 load_kv(const void *kv, size_t index, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + index))) : _mm512_loadu_ps((const float *)kv + index);
}

/* Layer l's keys (which = 0) or values (1) of key/value head h in a sequence's block: [capacity, head_dim]. */
static inline void *kv_head(const agentspec_segment *seg, int l, int which, int h, int kv_heads, int head_dim, int half) {
    return (char *)seg->kv + (((size_t)l * 2 + which) * kv_heads + h) * (size_t)seg->capacity * head_dim * (half ? 2 : 4);
}

/* One token's key (value) of `head_dim` elements into slot `slot` of a head's keys (values), rounded
   to nearest-even for float16 (as torch rounds float32 to float16). */
static inline void store_kv(void *kv, size_t slot, const float *x, int head_dim, int half) {
    if (!half) {
        memcpy((float *)kv + slot * head_dim, x, sizeof(float) * head_dim);
        return;
    }
    for (int i = 0; i < head_dim; i += 16) /* head_dim: a multiple of 16 (blocks.py) */
        _mm256_storeu_si256((__m256i *)((uint16_t *)kv + slot * head_dim + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* e^x, 16 lanes (Cephes' single-precision polynomial, within 2 ulp; the same bits for a lane
   whatever its neighbours): 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* e^-87 ~ 1.6e-38: nothing below matters here */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The sums of 16 vectors' lanes, as one vector (lane j: the sum of a[j]'s lanes), by a fixed tree:
   pairs of elements within 128-bit lanes, then pairs of pairs, then the four 128-bit lanes. Every
   vector's sum takes the same additions in the same order wherever it sits among the 16, so a key's
   score does not depend on which keys share its chunk. */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: (a[2i] 0+2, a[2i+1] 0+2, a[2i] 1+3, a[2i+1] 1+3) */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: (0+2)+(1+3) of a[4i], a[4i+1], a[4i+2], a[4i+3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1 and 2+3 of c[2i], then of c[2i+1] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static void blocks_product(const agentspec_blocks *w, const float *x, int M, int K, float *y, int N, int threads) {
    switch (w->kind) {
    case 0: agentspec_q4_1_product(x, M, K, w->few, w->many, y, N, threads); break;
    case 1: agentspec_q8_0_product(x, M, K, w->few, w->many, y, N, threads); break;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    case 2: agentspec_q4_1_q8_product(x, M, K, w->few, y, N, threads); break;
    case 3: agentspec_q8_0_q8_product(x, M, K, w->few, y, N, threads); break;
    case 4: agentspec_q4_1_q16_product(x, M, K, w->few, y, N, threads); break;
    case 5: agentspec_q8_0_q16_product(x, M, K, w->few, y, N, threads); break;
#endif
    default: abort(); /* blocks.py lays out integer-row blocks only where agentspec_vnni */
    }
}

/* LlamaRMSNorm of each row: weight * (x * 1/sqrt(mean(x^2) + eps)). */
static void rms_norm(const float *x, int rows, int H, const float *weight, float eps, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * H;
        __m512 acc = _mm512_setzero_ps();
        int i = 0;
        for (; i + 16 <= H; i += 16) {
            const __m512 v = _mm512_loadu_ps(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float sum = _mm512_reduce_add_ps(acc);
        for (; i < H; i++) sum += xr[i] * xr[i];
        const float inverse = 1.0f / sqrtf(sum / (float)H + eps);
        for (int j = 0; j < H; j++) out[(size_t)r * H + j] = weight[j] * (xr[j] * inverse);
    }
}

/* Causal attention of one token's `queries` query heads (consecutive at q, head_dim apart) that
   share one key/value head, over its first `seen` keys and values ([seen, head_dim] each): softmax of
   the scaled scores, times the values, into out (the heads side by side). `chunks` = head_dim / 16,
   a compile-time constant at each call site (attend), so a query and the sums live in registers.
   The keys and values are read once for all the heads: 16 keys at a time, reused from cache by each
   head's scores; each value once for up to 12 / chunks heads' sums. Every head's arithmetic is the
   same whatever shares the chunk, the job or the pass: a key's score is one 16-lane accumulation
   summed by reduce16's tree, and a head's values are summed in key order. */
static inline __attribute__((always_inline)) void attend_chunks(const int chunks, const int half, const float *q, int queries, const void *keys,
                                                               const void *values, int seen, float scaling, float *p, size_t stride, float *out) {
    const int head_dim = 16 * chunks, group = chunks <= 4 ? 12 / chunks : 1;
    for (int s0 = 0; s0 < seen; s0 += 16) { /* scores */
        const int live = seen - s0 < 16 ? seen - s0 : 16;
        for (int h = 0; h < queries; h++) {
            __m512 query[8], dots[16];
            UNROLL for (int i = 0; i < 8; i++) if (i < chunks) query[i] = _mm512_loadu_ps(q + (size_t)h * head_dim + 16 * i);
            UNROLL for (int j = 0; j < 16; j++) {
                dots[j] = _mm512_setzero_ps();
                if (j < live) {
                    const size_t k = (size_t)(s0 + j) * head_dim;
                    UNROLL for (int i = 0; i < 8; i++) if (i < chunks) dots[j] = _mm512_fmadd_ps(query[i], load_kv(keys, k + 16 * i, half), dots[j]);
                }
            }
            _mm512_mask_storeu_ps(p + h * stride + s0, (__mmask16)((1u << live) - 1), _mm512_mul_ps(reduce16(dots), _mm512_set1_ps(scaling)));
        }
    }
    float total[queries];
    for (int h = 0; h < queries; h++) { /* softmax numerators and their sum, 16 scores at a time (the last chunk masked) */
        float *ph = p + h * stride;
        __m512 highest = _mm512_set1_ps(-INFINITY), sum16 = _mm512_setzero_ps();
        for (int s = 0; s < seen; s += 16) {
            const __mmask16 live = seen - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - s)) - 1);
            highest = _mm512_mask_max_ps(highest, live, highest, _mm512_maskz_loadu_ps(live, ph + s));
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(highest));
        for (int s = 0; s < seen; s += 16) {
            const __mmask16 live = seen - s >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (seen - s)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, ph + s), top));
            _mm512_mask_storeu_ps(ph + s, live, e);
            sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(live, e));
        }
        total[h] = _mm512_reduce_add_ps(sum16);
    }
    for (int h0 = 0; h0 < queries; h0 += group) { /* the numerators' weighted values in key order, divided by their sum */
        const int n = queries - h0 < group ? queries - h0 : group;
        __m512 sums[12][8];
        UNROLL for (int g = 0; g < 12; g++) UNROLL for (int i = 0; i < 8; i++) sums[g][i] = _mm512_setzero_ps();
        for (int s = 0; s < seen; s++) {
            __m512 v[8];
            UNROLL for (int i = 0; i < 8; i++) if (i < chunks) v[i] = load_kv(values, (size_t)s * head_dim + 16 * i, half);
            UNROLL for (int g = 0; g < 12; g++) {
                if (g < group && g < n) {
                    const __m512 weight = _mm512_set1_ps(p[(h0 + g) * stride + s]);
                    UNROLL for (int i = 0; i < 8; i++) if (i < chunks) sums[g][i] = _mm512_fmadd_ps(weight, v[i], sums[g][i]);
                }
            }
        }
        UNROLL for (int g = 0; g < 12; g++)
            if (g < group && g < n)
                UNROLL for (int i = 0; i < 8; i++)
                    if (i < chunks) _mm512_storeu_ps(out + (size_t)(h0 + g) * head_dim + 16 * i, _mm512_div_ps(sums[g][i], _mm512_set1_ps(total[h0 + g])));
    }
}

#define ATTEND_CHUNKS(HALF, CHUNKS) attend_chunks(CHUNKS, HALF, q, queries, keys, values, seen, scaling, p, stride, out);

static void attend(int half, const float *q, int queries, int head_dim, const void *keys, const void *values, int seen, float scaling, float *p,
                   size_t stride, float *out) {
    if (half) /* head_dim <= 128 (blocks.py) */
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 1)
    else
        BY_COUNT(head_dim / 16, ATTEND_CHUNKS, 0)
}

void agentspec_llama_layers(float *hidden, int T, int H, int heads, int kv_heads, int head_dim, int intermediate,
                            int layers, const agentspec_layer *weights, const float *cos, const float *sin, float scaling,
                            const agentspec_segment *segments, int nseg, int kv_half, int threads) {
    const int q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    const int groups = heads / kv_heads, half = head_dim / 2;
    int longest = 0;
    for (int s = 0; s < nseg; s++)
        if (segments[s].past + segments[s].stop - segments[s].start > longest) longest = segments[s].past + segments[s].stop - segments[s].start;
    float *normed = malloc(sizeof(float) * (size_t)T * (H > intermediate ? H : intermediate));
    float *qkv = malloc(sizeof(float) * (size_t)T * width);
    float *attn = malloc(sizeof(float) * (size_t)T * q_size);
    float *up = malloc(sizeof(float) * (size_t)T * 2 * intermediate);
    float *delta = malloc(sizeof(float) * (size_t)T * H);
    float *scores = malloc(sizeof(float) * (size_t)(threads > 0 ? threads : 1) * groups * (longest + 16));
    int *segment_of = malloc(sizeof(int) * (size_t)(T > 0 ? T : 1)); /* each token's sequence */
    for (int g = 0; g < nseg; g++)
        for (int t = segments[g].start; t < segments[g].stop; t++) segment_of[t] = g;
    for (int l = 0; l < layers; l++) {
        const agentspec_layer *w = weights + l;
        rms_norm(hidden, T, H, w->norm1, w->eps1, normed);
        blocks_product(&w->qkv, normed, T, H, qkv, width, threads);
        /* rotary embedding of queries and keys: x * cos + rotate_half(x) * sin */
        for (int t = 0; t < T; t++) {
            const float *c = cos + (size_t)t * head_dim, *s = sin + (size_t)t * head_dim;
            for (int h = 0; h < heads + kv_heads; h++) {
                float *x = qkv + (size_t)t * width + (size_t)h * head_dim;
                float rotated[head_dim];
                for (int i = 0; i < half; i++) {
                    rotated[i] = x[i] * c[i] + (-x[i + half]) * s[i];
                    rotated[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
                }
                memcpy(x, rotated, sizeof(float) * head_dim);
            }
        }
        /* this pass's keys and values into each sequence's block */
        for (int g = 0; g < nseg; g++) {
            const agentspec_segment *seg = segments + g;
            for (int t = seg->start; t < seg->stop; t++)
                for (int h = 0; h < kv_heads; h++) {
                    const size_t slot = (size_t)(seg->past + t - seg->start);
                    store_kv(kv_head(seg, l, 0, h, kv_heads, head_dim, kv_half), slot, qkv + (size_t)t * width + q_size + (size_t)h * head_dim, head_dim, kv_half);
                    store_kv(kv_head(seg, l, 1, h, kv_heads, head_dim, kv_half), slot, qkv + (size_t)t * width + q_size + kv_size + (size_t)h * head_dim,
                             head_dim, kv_half);
                }
        }
        /* causal attention: each token's query heads over its sequence's keys up to its own position,
           a job per (token, key/value head), all the pass's sequences in one parallel loop */
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int job = 0; job < T * kv_heads; job++) {
            const int t = job / kv_heads, kvh = job % kv_heads;
            const agentspec_segment *seg = segments + segment_of[t];
            attend(kv_half, qkv + (size_t)t * width + (size_t)kvh * groups * head_dim, groups, head_dim, kv_head(seg, l, 0, kvh, kv_heads, head_dim, kv_half),
                   kv_head(seg, l, 1, kvh, kv_heads, head_dim, kv_half), seg->past + (t - seg->start) + 1,
                   scaling, scores + (size_t)omp_get_thread_num() * groups * (longest + 16), longest + 16,
                   attn + (size_t)t * q_size + (size_t)kvh * groups * head_dim);
        }
        blocks_product(&w->o, attn, T, q_size, delta, H, threads);
        for (size_t i = 0; i < (size_t)T * H; i++) hidden[i] += delta[i];
        rms_norm(hidden, T, H, w->norm2, w->eps2, normed);
        blocks_product(&w->gate_up, normed, T, H, up, 2 * intermediate, threads);
        /* SiLU(gate) * up, gate / (1 + e^-gate) as torch computes it */
        for (int t = 0; t < T; t++) {
            const float *gate = up + (size_t)t * 2 * intermediate, *value = gate + intermediate;
            float *act = normed + (size_t)t * intermediate;
            int i = 0;
            for (; i + 16 <= intermediate; i += 16) {
                const __m512 g = _mm512_loadu_ps(gate + i);
                const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
                _mm512_storeu_ps(act + i, _mm512_mul_ps(silu, _mm512_loadu_ps(value + i)));
            }
            for (; i < intermediate; i++) act[i] = gate[i] / (1.0f + expf(-gate[i])) * value[i];
        }
        blocks_product(&w->down, normed, T, intermediate, delta, H, threads);
        for (size_t i = 0; i < (size_t)T * H; i++) hidden[i] += delta[i];
    }
    free(normed); free(qkv); free(attn); free(up); free(delta); free(scores); free(segment_of);
}
