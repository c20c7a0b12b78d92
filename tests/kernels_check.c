/* A check of agentspec/passes/blocks.c on one instruction-set level, linked with it, with no Python:
   how the kernels are tested where only an emulator runs them (ARM NEON under qemu-user on an x86
   machine: tests/test_blocks.py builds this for every level and compares what each prints).

   For Q4_1 and Q8_0 blocks (random codes, scales that are float16 values) times float32, 8-bit and
   16-bit rows, Q8_16 (a scale per 16 weights) and Q8_1 (unsigned bytes, a minimum) blocks times
   float32 rows, and the codes of Q4_0, Q5_0, Q5_1, Q6_K (a scale per 16) and the K-quants' scales (no
   float16 values) in the integer products' 4-, 5- and 6-bit layouts times 8- and 16-bit rows, it checks that a product is row- and thread-invariant (a row alone, among 16, in a
   subset, on 1 or 2 threads: the same bits) and agrees with a plain reference (float64 sums of the
   dequantised weights; for integer rows, exact integer dot products scaled in float64). It runs the
   decoder layers of a tiny random model on float32 and float16 caches, two sequences in one pass and
   one alone (the same bits), then a second pass over the cache. It lays random rows of each GGUF type
   out with the kernels' repacker and multiplies them. It prints one hash of every result's
   bits per case: every level must print the same lines. Exit status 1 on a failed check. */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../agentspec/passes/blocks.h" /* the kernels' structures and functions */

typedef agentspec_blocks blocks_arg;
typedef agentspec_layer layer_arg;
typedef agentspec_segment segment_arg;

static int failures = 0;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            failures++;                                                                            \
            printf("FAILED: " __VA_ARGS__);                                                        \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

static uint64_t state = 0x9E3779B97F4A7C15u;
static uint32_t next(void) { /* xorshift64 */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)(state >> 32);
}
static float uniform(void) { return (float)(next() >> 8) / 8388608.0f - 1.0f; } /* [-1, 1), exact */

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) { /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001B3u;
    return h;
}

static uint16_t half_bits(float x) { /* x is a float16 value (finite): its bits, exactly (no _Float16: clang 14 has none on x86) */
    uint16_t sign = signbit(x) ? 0x8000u : 0;
    float a = fabsf(x);
    if (a < 6.103515625e-05f) return sign | (uint16_t)(a * 16777216.0f); /* zero or subnormal: a / 2^-24 */
    int e;
    float m = frexpf(a, &e); /* a = m 2^e, m in [0.5, 1) */
    return sign | (uint16_t)((e + 14) << 10) | (uint16_t)((m * 2.0f - 1.0f) * 1024.0f);
}

/* The blocks checked: the kernels' four block types, and the GGUF types whose codes or scales the
   integer products read in layouts of their own (Q4_K: Q4_1's blocks with scales and minimums that
   are no float16 values but 8-bit factors of a float16 one per super-block; Q4_0 and Q5_0: Q8_0's
   blocks with 4- and 5-bit codes; Q5_1 and Q5_K: Q8_1's with 5-bit codes; Q6_K: Q8_16's with 6-bit
   codes and factored scales) */
enum { Q4_1, Q8_0, Q8_16, Q8_1, Q4_K, Q4_0, Q5_0, Q5_1, Q5_K, Q6_K, KINDS };
static const char *names[KINDS] = {"Q4_1", "Q8_0", "Q8_16", "Q8_1", "Q4_K", "Q4_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"};
static const int base[KINDS] = {Q4_1, Q8_0, Q8_16, Q8_1, Q4_1, Q8_0, Q8_0, Q8_1, Q8_1, Q8_16}; /* the block type its codes are stored as */

typedef struct {
    int kind, N, K;
    uint8_t *codes; /* [N, K / 32, 16 (Q4_1) or 32], as the file stores them (Q8_0, Q8_16: signed) */
    float *d, *m;   /* [N, K / 32] (Q8_16: d [N, K / 16]), float16 values but for the factored kinds */
    int8_t *f;      /* factored kinds: [N, K / 32, scales per block + minimum] the factors of d (and m) */
    float *s;       /* factored kinds: [N, super-blocks, 2] the float16 values they multiply (d's, m's) */
} blocks;

static int has_mins(int kind) { return base[kind] == Q4_1 || base[kind] == Q8_1; }
static int is_factored(int kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }
static int halves(int kind) { return base[kind] == Q8_16; } /* a scale per 16 weights */
#define SUPER 8 /* blocks per super-block */

static blocks make_blocks(int kind, int N, int K) {
    const int nb = K / 32, bytes = base[kind] == Q4_1 ? 16 : 32, supers = (nb + SUPER - 1) / SUPER, spans = halves(kind) ? 2 : 1, per = spans + has_mins(kind);
    blocks b = {kind, N, K, malloc((size_t)N * nb * bytes), malloc(sizeof(float) * N * nb * 2), malloc(sizeof(float) * N * nb),
                malloc((size_t)N * nb * per), malloc(sizeof(float) * N * supers * 2)};
    for (size_t i = 0; i < (size_t)N * nb * bytes; i++) {
        const uint32_t r = next();
        b.codes[i] = kind == Q4_0 ? (uint8_t)(int8_t)((int)(r % 16) - 8) : kind == Q5_0 ? (uint8_t)(int8_t)((int)(r % 32) - 16)
                   : kind == Q6_K ? (uint8_t)(int8_t)((int)(r % 64) - 32) : kind == Q5_1 || kind == Q5_K ? (uint8_t)(r % 32) : (uint8_t)r;
    }
    for (size_t i = 0; i < (size_t)N * nb * 2; i++) b.d[i] = (float)(1 + next() % 1000) / 65536.0f;
    for (size_t i = 0; i < (size_t)N * nb; i++) b.m[i] = has_mins(kind) ? -(float)(next() % 1000) / 8192.0f : 0.0f;
    if (is_factored(kind)) { /* products of a float16 value and an 8-bit factor (Q6_K's signed, the others' 6-bit), as the K-quants': no float16 values */
        for (size_t i = 0; i < (size_t)N * supers; i++) b.s[2 * i] = (float)(1 + next() % 1000) / 65536.0f, b.s[2 * i + 1] = -(float)(next() % 1000) / 8192.0f;
        for (size_t i = 0; i < (size_t)N * nb * per; i++) b.f[i] = kind == Q6_K ? (int8_t)(next() % 256) : (int8_t)(next() % 64);
        for (int n = 0; n < N; n++)
            for (int k = 0; k < nb; k++) {
                const size_t at = (size_t)n * nb + k;
                const float *s = b.s + ((size_t)n * supers + k / SUPER) * 2;
                for (int h = 0; h < spans; h++) b.d[at * spans + h] = s[0] * (float)b.f[at * per + h];
                if (has_mins(kind)) b.m[at] = s[1] * (float)b.f[at * per + spans];
            }
    }
    return b;
}

static int code(const blocks *b, int n, int k) { /* weight k of output n's code */
    const int kind = base[b->kind];
    const uint8_t *c = b->codes + ((size_t)n * (b->K / 32) + k / 32) * (kind == Q4_1 ? 16 : 32);
    if (kind == Q8_1) return c[k % 32];
    return kind != Q4_1 ? (int)(int8_t)c[k % 32] : (k % 32 < 16 ? c[k % 32] & 15 : c[k % 32 - 16] >> 4);
}

static float weight(const blocks *b, int n, int k) { /* as the GGUF reader rounds it: a product, then a sum */
    const size_t at = (size_t)n * (b->K / 32) + k / 32;
    const float product = (b->kind == Q8_16 ? b->d[(size_t)n * (b->K / 16) + k / 16] : b->d[at]) * (float)code(b, n, k);
    return has_mins(b->kind) ? product + b->m[at] : product;
}

/* Blocks.grouped(G): per group of G outputs, per block, the G outputs' codes, scales, minimums (float32) */
static uint8_t *grouped(const blocks *b, int G) {
    const int kind = base[b->kind], nb = b->K / 32, bytes = kind == Q4_1 ? 16 : 32, groups = (b->N + G - 1) / G, scales = kind == Q8_16 ? 2 : 1;
    const int mins = has_mins(kind), per = G * (bytes + 4 * scales + 4 * mins);
    uint8_t *out = calloc((size_t)groups * nb * per, 1);
    for (int n = 0; n < b->N; n++)
        for (int k = 0; k < nb; k++) {
            uint8_t *at = out + ((size_t)(n / G) * nb + k) * per;
            const size_t src = (size_t)n * nb + k;
            memcpy(at + (n % G) * bytes, b->codes + src * bytes, bytes);
            memcpy(at + G * bytes + (n % G) * 4 * scales, b->d + src * scales, 4 * scales);
            if (mins) memcpy(at + G * (bytes + 4) + (n % G) * 4, b->m + src, 4);
        }
    return out;
}

/* The integer products' layout of a kind (Blocks.integer_layout): codes 0 (bytes), 1 (4-bit), 2
   (5-bit) or 3 (6-bit), minimums, factored scales, halves; its number times 1 or 2 planes (blocks.c: INT_LAYOUT) */
static int codes_of(int kind) { return kind == Q8_0 ? 0 : kind == Q4_1 || kind == Q4_K || kind == Q4_0 ? 1 : kind == Q6_K ? 3 : 2; }
static int layout_number(int kind, int planes) {
    return (((codes_of(kind) * 2 + has_mins(kind)) * 2 + is_factored(kind)) * 2 + halves(kind)) * 2 + planes - 1;
}

/* Blocks.by_lanes(L): per group of L outputs, per block, registers j of L lanes (lane o: output o's
   codes 4j..4j+3 as bytes, plus 128; or 4-bit codes as the file packs them, then registers of fifth
   and sixth bits, bit 8i + j code 4j + i's), then the scales (each half's with halves) and minimums
   as float16; factored, as their signed 8-bit factors, and before each super-block of SUPER blocks the
   float16 values they multiply (d's, then m's) */
static uint8_t *by_lanes(const blocks *b, int L) {
    const int codes = codes_of(b->kind), mins = has_mins(b->kind), factored = is_factored(b->kind), size = factored ? 1 : 2, spans = halves(b->kind) ? 2 : 1;
    const int nb = b->K / 32, bytes = codes == 0 ? 32 : 12 + 4 * codes, groups = (b->N + L - 1) / L, per = L * bytes + L * size * (spans + mins);
    const int offset = mins ? 0 : codes == 0 ? 128 : 4 << codes, head = factored ? L * 2 * (1 + mins) : 0, supers = (nb + SUPER - 1) / SUPER;
    const size_t group = (size_t)supers * head + (size_t)nb * per; /* a group's bytes (head: 0 unless factored) */
    uint8_t *out = calloc((size_t)groups * group, 1);
    for (int n = 0; n < b->N; n++)
        for (int k = 0; k < nb; k++) {
            uint8_t *first = out + (size_t)(n / L) * group + (size_t)(k / SUPER) * (head + SUPER * per); /* its super-block's */
            uint8_t *at = first + head + (size_t)(k % SUPER) * per, stored[32];
            const size_t src = (size_t)n * nb + k;
            int q[32];
            for (int i = 0; i < 32; i++) q[i] = code(b, n, k * 32 + i) + offset;
            if (codes == 0) {
                for (int i = 0; i < 32; i++) stored[i] = (uint8_t)q[i];
            } else {
                for (int i = 0; i < 16; i++) stored[i] = (uint8_t)((q[i] & 15) | ((q[16 + i] & 15) << 4));
                for (int bit = 4; bit < 3 + codes; bit++) { /* 5-bit: bit 4; 6-bit: bits 4 and 5 */
                    uint32_t upper = 0;
                    for (int c = 0; c < 32; c++) upper |= (uint32_t)((q[c] >> bit) & 1) << (8 * (c % 4) + c / 4);
                    for (int i = 0; i < 4; i++) stored[16 + 4 * (bit - 4) + i] = (uint8_t)(upper >> (8 * i));
                }
            }
            for (int i = 0; i < bytes; i++) at[(i / 4) * L * 4 + (n % L) * 4 + i % 4] = stored[i];
            if (factored) {
                for (int h = 0; h < spans + mins; h++) at[L * bytes + h * L + n % L] = (uint8_t)b->f[src * (spans + mins) + h];
                const float *s = b->s + ((size_t)n * supers + k / SUPER) * 2;
                const uint16_t d = half_bits(s[0]), m = half_bits(s[1]);
                memcpy(first + (n % L) * 2, &d, 2);
                if (mins) memcpy(first + L * 2 + (n % L) * 2, &m, 2);
                continue;
            }
            const uint16_t d = half_bits(b->d[src]), m = half_bits(b->m[src]);
            memcpy(at + L * bytes + (n % L) * 2, &d, 2);
            if (mins) memcpy(at + L * bytes + L * 2 + (n % L) * 2, &m, 2);
        }
    return out;
}

typedef struct {
    const blocks *b;
    int activations; /* 0: float32 rows; 1: 8 bits; 2: 16 bits */
    uint8_t *few, *many;
} product;

static product make_product(const blocks *b, int activations) {
    product p = {b, activations, NULL, NULL};
    if (activations == 0) p.few = grouped(b, 8), p.many = grouped(b, 4);
    else p.few = by_lanes(b, agentspec_lanes);
    return p;
}

static void run(const product *p, const float *x, int M, float *y, int threads) {
    const blocks *b = p->b;
    int status;
    if (p->activations) {
        status = agentspec_int_product(layout_number(b->kind, p->activations), x, M, b->K, p->few, y, b->N, threads);
    } else {
        switch (base[b->kind]) {
        case Q4_1: status = agentspec_q4_1_product(x, M, b->K, p->few, p->many, y, b->N, threads); break;
        case Q8_0: status = agentspec_q8_0_product(x, M, b->K, p->few, p->many, y, b->N, threads); break;
        case Q8_16: status = agentspec_q8_16_product(x, M, b->K, p->few, p->many, y, b->N, threads); break;
        default: status = agentspec_q8_1_product(x, M, b->K, p->few, p->many, y, b->N, threads); break;
        }
    }
    CHECK(status == AGENTSPEC_OK, "product %s (%d rows): status %d", names[b->kind], M, status);
}

/* blocks.c's agentspec_blocks.kind of a product (blocks.py: _blocks_arg) */
static int kind_arg(const product *p) { return p->activations ? 4 + layout_number(p->b->kind, p->activations) : base[p->b->kind]; }

/* What the product computes, in float64: float32 rows times the dequantised weights; integer rows
   quantised per block (scale max|x| / top, codes rounded to nearest even), exact integer dot products */
static double reference(const blocks *b, int activations, const float *x, int n) {
    const int nb = b->K / 32;
    double sum = 0.0;
    for (int k0 = 0; k0 < nb; k0++) {
        const float *xb = x + k0 * 32;
        if (activations == 0) {
            for (int i = 0; i < 32; i++) sum += (double)xb[i] * (double)weight(b, n, k0 * 32 + i);
            continue;
        }
        const float top_code = activations == 1 ? 127.0f : 32639.0f;
        float top = 0.0f;
        for (int i = 0; i < 32; i++) top = fmaxf(top, fabsf(xb[i]));
        float inverse = top > 0.0f ? top_code / top : 0.0f, d_a = top / top_code;
        if (isinf(inverse)) inverse = 0.0f, d_a = 0.0f; /* a block too small for a scale: zeros (blocks.c) */
        const int spans = halves(b->kind) ? 2 : 1;
        int64_t codes = 0;
        const size_t at = (size_t)n * nb + k0;
        for (int h = 0; h < spans; h++) { /* a dot product per scale */
            int64_t dot = 0;
            for (int i = h * 32 / spans; i < (h + 1) * 32 / spans; i++) {
                const int64_t a = (int64_t)nearbyintf(xb[i] * inverse);
                dot += a * code(b, n, k0 * 32 + i), codes += a;
            }
            sum += (double)b->d[at * spans + h] * d_a * (double)dot;
        }
        sum += (double)b->m[at] * ((double)d_a * (double)codes);
    }
    return sum;
}

static uint64_t check_product(int kind, int activations) {
    const int M = 16, K = 320, N = 37; /* 37 outputs: a last group of every width partly empty; 10 blocks: a last super-block of 2 */
    blocks b = make_blocks(kind, N, K);
    product p = make_product(&b, activations);
    float *x = malloc(sizeof(float) * M * K), *all = malloc(sizeof(float) * M * N), *part = malloc(sizeof(float) * M * N);
    for (int i = 0; i < M * K; i++) x[i] = uniform();
    memset(x + 3 * K + 32, 0, sizeof(float) * 32); /* a block of zeros: scale 0 */
    memset(x + 5 * K, 0, sizeof(float) * K); /* a row of zeros but a block too small for a scale (1e-37 / 127 is no float): zeros too */
    x[5 * K + 70] = 1e-37f;
    run(&p, x, M, all, 2);
    const char *name = names[kind];
    for (int r = 0; r < M; r++) {
        run(&p, x + (size_t)r * K, 1, part, 2);
        CHECK(memcmp(part, all + (size_t)r * N, sizeof(float) * N) == 0, "%s x %d-bit rows: row %d alone differs", name, 8 * activations, r);
    }
    run(&p, x + 7 * K, 9, part, 2); /* a tile of 8 and a remainder of 1, from row 7 */
    CHECK(memcmp(part, all + 7 * N, sizeof(float) * 9 * N) == 0, "%s x %d-bit rows: rows 7..15 differ", name, 8 * activations);
    run(&p, x + 2 * K, 5, part, 2); /* a tile of 5 (the fewest rows AMX takes) */
    CHECK(memcmp(part, all + 2 * N, sizeof(float) * 5 * N) == 0, "%s x %d-bit rows: rows 2..6 differ", name, 8 * activations);
    run(&p, x, M, part, 1);
    CHECK(memcmp(part, all, sizeof(float) * M * N) == 0, "%s x %d-bit rows: one thread differs from two", name, 8 * activations);
    double worst = 0.0;
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            const double want = reference(&b, activations, x + (size_t)r * K, n);
            worst = fmax(worst, fabs(all[(size_t)r * N + n] - want) / (1.0 + fabs(want)));
        }
    CHECK(worst < 1e-5, "%s x %d-bit rows: %.3g from the reference", name, 8 * activations, worst);
    const uint64_t h = hash_bytes(0xCBF29CE484222325u, all, sizeof(float) * M * N);
    free(x), free(all), free(part), free(p.few), free(p.many), free(b.codes), free(b.d), free(b.m), free(b.f), free(b.s);
    return h;
}

/* The decoder layers of a tiny random model: 2 layers, hidden 64, 4 query heads and 2 key/value heads
   of 16, MLP 96; products on Q5_0 (q/k/v), Q4_1 (output), Q5_1 (gate/up) and Q8_0 (down) blocks times
   float32 or 16-bit rows. The
   second layer has every switch of the described blocks on: q/k/v biases, q/k norms, a window of 3
   positions, no rotary embedding, norms after attention and MLP, a GELU gate, scores soft-capped at
   2; the residuals are scaled by 0.5. */
enum { LAYERS = 2, H = 64, HEADS = 4, KV_HEADS = 2, HEAD_DIM = 16, MLP = 96, CAPACITY = 16 };

static uint64_t check_layers(int activations, int key_half, int value_half) {
    static blocks weights[LAYERS][4];
    static float norms[LAYERS][2][H], bias[(HEADS + 2 * KV_HEADS) * HEAD_DIM], qk_norms[2][HEAD_DIM], post[2][H];
    for (int i = 0; i < 2 * H; i++) post[i / H][i % H] = 0.5f + 0.5f * fabsf(uniform());
    for (int i = 0; i < (HEADS + 2 * KV_HEADS) * HEAD_DIM; i++) bias[i] = 0.1f * uniform();
    for (int i = 0; i < 2 * HEAD_DIM; i++) qk_norms[i / HEAD_DIM][i % HEAD_DIM] = 0.5f + 0.5f * fabsf(uniform());
    layer_arg layers[LAYERS];
    const int shapes[4][3] = {{Q5_0, (HEADS + 2 * KV_HEADS) * HEAD_DIM, H}, {Q4_1, H, HEADS * HEAD_DIM}, {Q5_1, 2 * MLP, H}, {Q8_0, H, MLP}}; /* kind, N, K */
    product products[LAYERS][4];
    for (int l = 0; l < LAYERS; l++) {
        for (int i = 0; i < 4; i++) {
            weights[l][i] = make_blocks(shapes[i][0], shapes[i][1], shapes[i][2]);
            products[l][i] = make_product(&weights[l][i], activations);
        }
        for (int i = 0; i < 2 * H; i++) norms[l][i / H][i % H] = 0.5f + 0.5f * fabsf(uniform());
        blocks_arg args[4];
        for (int i = 0; i < 4; i++) args[i] = (blocks_arg){kind_arg(&products[l][i]), products[l][i].few, products[l][i].many};
        layers[l] = (layer_arg){norms[l][0], norms[l][1], 1e-5f, 1e-5f, args[0], args[1], args[2], args[3], NULL, NULL, NULL, 0.0f, 0, 1, NULL, NULL, 0.0f, 0, 0.0f};
        if (l == 1)
            layers[l].qkv_bias = bias, layers[l].q_norm = qk_norms[0], layers[l].k_norm = qk_norms[1], layers[l].qk_eps = 1e-6f, layers[l].window = 3,
            layers[l].rotary = 0, layers[l].post_attention = post[0], layers[l].post_mlp = post[1], layers[l].post_eps = 1e-6f, layers[l].gelu = 1,
            layers[l].softcap = 2.0f;
    }
    /* each sequence's keys, then its values: [LAYERS, KV_HEADS, CAPACITY, HEAD_DIM] each, float16 or float32 */
    const size_t key_bytes = (size_t)LAYERS * KV_HEADS * CAPACITY * HEAD_DIM * (key_half ? 2 : 4);
    const size_t kv_bytes = key_bytes + (size_t)LAYERS * KV_HEADS * CAPACITY * HEAD_DIM * (value_half ? 2 : 4);
    char *kv_a = calloc(kv_bytes, 1), *kv_b = calloc(kv_bytes, 1), *kv_alone = calloc(kv_bytes, 1);
    float cos_[8 * HEAD_DIM], sin_[8 * HEAD_DIM], hidden[8 * H], alone[5 * H];
    for (int t = 0; t < 8; t++)
        for (int i = 0; i < HEAD_DIM; i++) cos_[t * HEAD_DIM + i] = cosf(0.3f * t * (i % 8 + 1)), sin_[t * HEAD_DIM + i] = sinf(0.3f * t * (i % 8 + 1));
    for (int i = 0; i < 8 * H; i++) hidden[i] = uniform();
    memcpy(alone, hidden, sizeof(alone));
    /* one pass: sequence a's 5 tokens and sequence b's 3 (positions 0..4 and 0..2) */
    float cos8[8 * HEAD_DIM], sin8[8 * HEAD_DIM];
    for (int t = 0; t < 8; t++) {
        const int position = t < 5 ? t : t - 5;
        memcpy(cos8 + t * HEAD_DIM, cos_ + position * HEAD_DIM, sizeof(float) * HEAD_DIM);
        memcpy(sin8 + t * HEAD_DIM, sin_ + position * HEAD_DIM, sizeof(float) * HEAD_DIM);
    }
    const float scaling = 0.25f; /* 1 / sqrt(16) */
    segment_arg both[2] = {{0, 5, 0, CAPACITY, kv_a, kv_a + key_bytes}, {5, 8, 0, CAPACITY, kv_b, kv_b + key_bytes}};
    segment_arg one[1] = {{0, 5, 0, CAPACITY, kv_alone, kv_alone + key_bytes}};
    CHECK(agentspec_layers(hidden, 8, H, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, layers, cos8, sin8, HEAD_DIM, scaling, 0.5f, both, 2, key_half, value_half, 2) == 0,
          "layers: a pass of two sequences refused");
    CHECK(agentspec_layers(alone, 5, H, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, layers, cos8, sin8, HEAD_DIM, scaling, 0.5f, one, 1, key_half, value_half, 1) == 0,
          "layers: a pass of one sequence refused");
    CHECK(memcmp(alone, hidden, sizeof(alone)) == 0, "layers (%d-bit rows, %s keys, %s values): a sequence alone differs", 16 * (activations > 0),
          key_half ? "float16" : "float32", value_half ? "float16" : "float32");
    CHECK(memcmp(kv_alone, kv_a, kv_bytes) == 0, "layers: a sequence's keys and values alone differ");
    uint64_t h = hash_bytes(0xCBF29CE484222325u, hidden, sizeof(hidden));
    /* a second pass: 2 more tokens of sequence a over its 5 */
    float more[2 * H];
    for (int i = 0; i < 2 * H; i++) more[i] = uniform();
    segment_arg again[1] = {{0, 2, 5, CAPACITY, kv_a, kv_a + key_bytes}};
    CHECK(agentspec_layers(more, 2, H, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS, layers, cos_ + 5 * HEAD_DIM, sin_ + 5 * HEAD_DIM, HEAD_DIM, scaling, 0.5f, again,
                           1, key_half, value_half, 2) == 0,
          "layers: a second pass refused");
    for (int i = 0; i < 2 * H; i++) CHECK(isfinite(more[i]), "layers: a second pass gave %g", more[i]);
    h = hash_bytes(h, more, sizeof(more));
    h = hash_bytes(h, kv_a, kv_bytes);
    /* refused, with nothing written: a sequence past its block's capacity, a layer's blocks of an
       unknown layout, a chain of parts whose outputs are not the product's, a head size attention
       does not take, no threads */
    float kept[2 * H];
    char *kv_kept = malloc(kv_bytes);
    memcpy(kept, more, sizeof(more)), memcpy(kv_kept, kv_a, kv_bytes);
    segment_arg past_end[1] = {{0, 2, CAPACITY - 1, CAPACITY, kv_a, kv_a + key_bytes}};
    layer_arg unknown[LAYERS], chained[LAYERS];
    memcpy(unknown, layers, sizeof(layers)), memcpy(chained, layers, sizeof(layers));
    unknown[1].down.kind = INTEGER_KIND + 999;
    blocks_arg second = chained[0].o;
    chained[0].o.outputs = H / 2, chained[0].o.next = &second, second.outputs = H / 2 + 1;
    const float *cos5 = cos_ + 5 * HEAD_DIM, *sin5 = sin_ + 5 * HEAD_DIM;
#define LAYERS_CALL(WEIGHTS, HEAD, SEGMENTS, THREADS) \
    agentspec_layers(more, 2, H, HEADS, KV_HEADS, HEAD, MLP, LAYERS, WEIGHTS, cos5, sin5, HEAD_DIM, scaling, 0.5f, SEGMENTS, 1, key_half, value_half, THREADS)
    CHECK(LAYERS_CALL(layers, HEAD_DIM, past_end, 2) == AGENTSPEC_BAD_ARGUMENT, "layers: a sequence past its block's capacity was not refused");
    CHECK(LAYERS_CALL(unknown, HEAD_DIM, again, 2) == AGENTSPEC_UNKNOWN_LAYOUT, "layers: an unknown layout was not refused");
    CHECK(LAYERS_CALL(chained, HEAD_DIM, again, 2) == AGENTSPEC_BAD_ARGUMENT, "layers: a chain of parts of too many outputs was not refused");
    CHECK(LAYERS_CALL(layers, 8, again, 2) == AGENTSPEC_BAD_ARGUMENT, "layers: a head size of 8 was not refused");
    CHECK(LAYERS_CALL(layers, HEAD_DIM, again, 0) == AGENTSPEC_BAD_ARGUMENT, "layers: no threads was not refused");
#undef LAYERS_CALL
    CHECK(memcmp(kept, more, sizeof(more)) == 0 && memcmp(kv_kept, kv_a, kv_bytes) == 0, "layers: a refused call wrote");
    free(kv_kept);
    for (int l = 0; l < LAYERS; l++)
        for (int i = 0; i < 4; i++) free(products[l][i].few), free(products[l][i].many), free(weights[l][i].codes), free(weights[l][i].d), free(weights[l][i].m), free(weights[l][i].f), free(weights[l][i].s);
    free(kv_a), free(kv_b), free(kv_alone);
    return h;
}

/* agentspec_gguf_by_lanes on random rows of each GGUF type (float16 scales of sane sizes), in the
   layout the type takes (integer_layout_of: factored for the K-quants), then the 16-bit product on
   them: every level lays its own lanes out, and must give the same product bits (and statistics). */
static uint64_t check_repack(int type) {
    enum { N = 40, K = 512, M = 3 }; /* 40 outputs: a last group of 8 lanes on AVX-512 */
    const int super = type >= 12 ? 256 : 32, bytes = type == 2 ? 18 : type == 3 ? 20 : type == 6 ? 22 : type == 7 ? 24 : type == 8 ? 34 : type == 12 ? 144 : type == 13 ? 176 : 210;
    const int codes = type == 8 ? 0 : type == 2 || type == 3 || type == 12 ? 1 : type == 14 ? 3 : 2;
    const int mins = type == 3 || type == 7 || type == 12 || type == 13, factored = type >= 12, halves = type == 14;
    const size_t row_bytes = (size_t)K / super * bytes;
    uint8_t *raw = malloc(N * row_bytes), *out = calloc(N + 16, row_bytes * 2);
    const uint8_t *rows[N];
    int types[N], stats[3];
    for (size_t i = 0; i < N * row_bytes; i++) raw[i] = (uint8_t)next();
    for (int r = 0; r < N; r++) {
        rows[r] = raw + r * row_bytes, types[r] = type;
        for (int b = 0; b < K / super; b++)
            for (int h = 0; h < 2; h++) { /* d (and the minimum's): 2^-9 .. 2^-8 */
                const int at = type == 14 ? 208 : 2 * h;
                if (h && !mins) break;
                const uint16_t v = (uint16_t)(0x1800 | (next() & 0x3ff));
                memcpy(raw + r * row_bytes + (size_t)b * bytes + at, &v, 2);
            }
    }
    CHECK(agentspec_gguf_statistics(rows, types, N, K, 2, stats) == 0, "repack %d: statistics", type);
    CHECK(agentspec_gguf_by_lanes(rows, types, N, K, codes, mins, factored, halves, 2, out, NULL) == 0, "repack %d: by lanes", type);
    int found[3]; /* and again, finding the statistics on the way: the same */
    CHECK(agentspec_gguf_by_lanes(rows, types, N, K, codes, mins, factored, halves, 2, out, found) == 0, "repack %d: by lanes with statistics", type);
    CHECK(found[0] == stats[0] && found[1] == stats[1] && found[2] == stats[2], "repack %d: statistics on the way %d %d %d, not %d %d %d", type, found[0],
          found[1], found[2], stats[0], stats[1], stats[2]);
    float x[M * K], y[M * N];
    for (int i = 0; i < M * K; i++) x[i] = uniform();
    CHECK(agentspec_int_product(((((codes * 2 + mins) * 2 + factored) * 2 + halves) * 2) + 1, x, M, K, out, y, N, 2) == 0, "repack %d: product", type);
    for (int i = 0; i < M * N; i++) CHECK(isfinite(y[i]), "repack %d: product %g", type, y[i]);
    uint64_t h = hash_bytes(0xcbf29ce484222325u, y, sizeof(y));
    h = hash_bytes(h, stats, sizeof(stats));
    free(raw), free(out);
    return h;
}

/* Products the kernels refuse, with nothing written: an unknown integer layout, counts they do not
   take, and rows whose working memory no machine has (its size kept for agentspec_failed_bytes). */
static void check_refusals(void) {
    static float x[64], y[16];
    static uint8_t w[4096];
    for (int i = 0; i < 16; i++) y[i] = 7.0f;
    const int q8_bytes = layout_number(Q8_0, 1);
    CHECK(agentspec_int_product(999, x, 1, 64, w, y, 16, 1) == AGENTSPEC_UNKNOWN_LAYOUT, "layout 999 was not refused");
    CHECK(agentspec_int_product(-1, x, 1, 64, w, y, 16, 1) == AGENTSPEC_UNKNOWN_LAYOUT, "layout -1 was not refused");
    CHECK(agentspec_int_product(q8_bytes, x, 1, 48, w, y, 16, 1) == AGENTSPEC_BAD_ARGUMENT, "48 inputs were not refused");
    CHECK(agentspec_q8_0_product(x, -1, 64, w, w, y, 16, 1) == AGENTSPEC_BAD_ARGUMENT, "-1 rows were not refused");
    CHECK(agentspec_q8_0_product(x, 1, 64, w, NULL, y, 16, 1) == AGENTSPEC_BAD_ARGUMENT, "no blocks for many rows were not refused");
    CHECK(agentspec_q4_1_product(x, 1, 64, w, w, y, 0, 1) == AGENTSPEC_BAD_ARGUMENT, "0 outputs were not refused");
    CHECK(agentspec_int_product(q8_bytes, x, INT32_MAX, 1 << 30, w, y, 16, 1) == AGENTSPEC_NO_MEMORY && agentspec_failed_bytes() > ((size_t)1 << 40),
          "rows of 2^30 inputs: not refused for memory (failed bytes %zu)", agentspec_failed_bytes());
    for (int i = 0; i < 16; i++) CHECK(y[i] == 7.0f, "a refused product wrote y[%d]", i);
    const uint8_t *rows[1] = {w};
    int types[1] = {12}, stats[3]; /* Q4_K: rows of whole super-blocks of 256 */
    CHECK(agentspec_gguf_statistics(rows, types, 1, 128, 1, stats) == AGENTSPEC_BAD_ARGUMENT, "a Q4_K row of 128 weights was not refused");
    CHECK(agentspec_gguf_by_lanes(rows, types, 1, 256, 1, 2, 1, 0, 1, w, NULL) == AGENTSPEC_BAD_ARGUMENT, "minimums = 2 were not refused");
}

int main(void) {
    if (!agentspec_cpu_runs_this()) { /* (and where it needs AMX, asks Linux for the tiles, as blocks.py does) */
        printf("this CPU does not run the kernels of this level\n");
        return 1;
    }
    const char *rows[3] = {"float32", "q8", "q16"};
    for (int activations = 0; activations < 3; activations++)
        for (int kind = 0; kind < KINDS; kind++) {
            if (activations ? kind == Q8_16 || kind == Q8_1 : kind > Q8_1) continue; /* Q8_16, Q8_1: float32 rows only; the rest: integer rows */
            printf("product %s %s %016llx\n", names[kind], rows[activations], (unsigned long long)check_product(kind, activations));
        }
    const int caches[3][2] = {{0, 0}, {1, 1}, {0, 1}}; /* float16 keys? float16 values? (float32 keys and float16 values: real models' key ranges) */
    for (int activations = 0; activations < 3; activations += 2)
        for (int c = 0; c < 3; c++)
            printf("layers %s %s-keys %s-values %016llx\n", rows[activations], caches[c][0] ? "float16" : "float32", caches[c][1] ? "float16" : "float32",
                   (unsigned long long)check_layers(activations, caches[c][0], caches[c][1]));
    const int gguf_types[8] = {2, 3, 6, 7, 8, 12, 13, 14}; /* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K */
    for (int t = 0; t < 8; t++) printf("repack %d %016llx\n", gguf_types[t], (unsigned long long)check_repack(gguf_types[t]));
    check_refusals();
    printf("%s\n", failures ? "FAILED" : "ok");
    return failures != 0;
}
