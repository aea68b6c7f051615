/* One AdamW update of a parameter whose state is stored compressed, in one pass over its blocks: decode the
 * moments, step, encode them again. See [Note: The compressed update's arithmetic] in _layouts.py: every
 * operation below is one IEEE binary32 operation, rounded to nearest, in the order written (compiled without
 * contraction into fused multiply-adds), so the torch path there gives the same bits.
 *
 * Moments (kind): 0 fp32 values, 1 bf16 values, 2 8-bit codes with one fp32 scale a block of BLOCK values.
 * Weight (kind): 0 fp32 stepped in place, 1 bf16 (the master rounded) plus the int16 low half of an fp32
 * master (see [Note: A rounded split]),
 * 2 bf16 alone, rounded back stochastically with the noise of [Note: Rounding noise] (_layouts.py).
 * Gradient (kind): 0 fp32, 1 bf16. All arrays hold the parameter's elements in the same (memory) order. */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* murmur3's 32-bit finalizer: every input bit moves about half the output bits. */
static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* Round to the nearest bf16, ties to even; a NaN becomes the quiet NaN 0x7FC0. */
static inline uint16_t bf16_nearest(float f) {
    uint32_t u = bits_of(f);
    if (f != f) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef struct {
    int64_t n;
    int moments, weight, grad, maximize;
    void *m, *v;          /* fp32 or bf16 values, or 8-bit codes */
    float *m_scales, *v_scales;
    const float *map_m, *map_v;          /* the 256 values of each map */
    const uint8_t *table_m, *table_v;    /* code of each bf16 bit pattern (as int16, plus 2^15) */
    void *w;
    int16_t *low;
    uint32_t seed_lo, seed_hi;  /* of the rounding noise */
    const void *g;
    float decay, b1, omb1, b2, omb2, bc2_sqrt, eps, step_size;
} update_args;

/* A moment's values as stored: fp32 or bf16 values, or for 8 bits the map's values (the block's scale is
 * applied in the update's loop, where it vectorizes: a product by 1 changes no value of the other kinds). */
static void load_moment(int kind, const void *src, const float *map, int64_t at, int len, float *out) {
    if (kind == 0) {
        memcpy(out, (const float *)src + at, (size_t)len * 4);
    } else if (kind == 1) {
        const uint16_t *h = (const uint16_t *)src + at;
        for (int i = 0; i < len; i++) out[i] = bf16_to_float(h[i]);
    } else {
        const uint8_t *c = (const uint8_t *)src + at;
        for (int i = 0; i < len; i++) out[i] = map[c[i]];
    }
}

/* Store a moment's new values; ``top`` is the largest of their absolute values' bit patterns (NaN above all). */
static void store_moment(int kind, void *dst, float *scales, const uint8_t *table, int64_t at, int len,
                         const float *x, uint32_t top) {
    if (kind == 0) {
        memcpy((float *)dst + at, x, (size_t)len * 4);
        return;
    }
    if (kind == 1) {
        uint16_t *h = (uint16_t *)dst + at;
        for (int i = 0; i < len; i++) h[i] = bf16_nearest(x[i]);
        return;
    }
    float absmax = top > 0x7F800000u ? NAN : float_of(top);  /* a NaN anywhere: the block decodes to NaN */
    scales[at / BLOCK] = absmax;
    float divisor = absmax < 1.17549435e-38f ? 1.17549435e-38f : absmax;  /* FLT_MIN; NaN stays NaN */
    const float inverse = 1.0f / divisor;
    uint16_t index[BLOCK];
    for (int i = 0; i < len; i++) index[i] = bf16_nearest(x[i] * inverse) ^ 0x8000u;  /* (int16)h + 2^15 */
    uint8_t *c = (uint8_t *)dst + at;
    for (int i = 0; i < len; i++) c[i] = table[index[i]];
}

static void step_block(const update_args *a, int64_t at, int len) {
    float m[BLOCK], v[BLOCK], p[BLOCK], g[BLOCK];
    load_moment(a->moments, a->m, a->map_m, at, len, m);
    load_moment(a->moments, a->v, a->map_v, at, len, v);
    const float m_scale = a->moments == 2 ? a->m_scales[at / BLOCK] : 1.0f;
    const float v_scale = a->moments == 2 ? a->v_scales[at / BLOCK] : 1.0f;
    if (a->weight == 0) {
        memcpy(p, (float *)a->w + at, (size_t)len * 4);
    } else if (a->weight == 1) {
        const uint16_t *hi = (const uint16_t *)a->w + at;
        const uint16_t *lo = (const uint16_t *)a->low + at;
        for (int i = 0; i < len; i++)  /* the weight was rounded up where the low half is 0x8000 or more */
            p[i] = float_of(((uint32_t)(uint16_t)(hi[i] - (lo[i] >> 15)) << 16) | lo[i]);
    } else {
        const uint16_t *hi = (const uint16_t *)a->w + at;
        for (int i = 0; i < len; i++) p[i] = bf16_to_float(hi[i]);
    }
    if (a->grad == 0) {
        memcpy(g, (const float *)a->g + at, (size_t)len * 4);
    } else {
        const uint16_t *h = (const uint16_t *)a->g + at;
        for (int i = 0; i < len; i++) g[i] = bf16_to_float(h[i]);
    }
    if (a->maximize)
        for (int i = 0; i < len; i++) g[i] = -g[i];
    const float decay = a->decay, b1 = a->b1, omb1 = a->omb1, b2 = a->b2, omb2 = a->omb2;
    const float bc2_sqrt = a->bc2_sqrt, eps = a->eps, step_size = a->step_size;
    uint32_t m_top = 0, v_top = 0;
    for (int i = 0; i < len; i++) {
        float gi = g[i];
        float pi = p[i] * decay;
        float mi = (m[i] * m_scale) * b1 + gi * omb1;
        float vi = (v[i] * v_scale) * b2 + (gi * gi) * omb2;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi - (mi / denom) * step_size;
        m[i] = mi;
        v[i] = vi;
        uint32_t ma = bits_of(mi) & 0x7FFFFFFFu, va = bits_of(vi) & 0x7FFFFFFFu;  /* |x| as bits orders as |x| */
        m_top = ma > m_top ? ma : m_top;
        v_top = va > v_top ? va : v_top;
    }
    store_moment(a->moments, a->m, a->m_scales, a->table_m, at, len, m, m_top);
    store_moment(a->moments, a->v, a->v_scales, a->table_v, at, len, v, v_top);
    if (a->weight == 0) {
        memcpy((float *)a->w + at, p, (size_t)len * 4);
    } else if (a->weight == 1) {
        uint16_t *hi = (uint16_t *)a->w + at;
        uint16_t *lo = (uint16_t *)a->low + at;
        for (int i = 0; i < len; i++) {  /* the weight rounded to nearest, a tie away from zero; NaN stays NaN */
            uint32_t u = bits_of(p[i]);
            uint16_t top = (uint16_t)(u >> 16), low = (uint16_t)u;
            hi[i] = p[i] != p[i] ? (uint16_t)((top & 0x8000u) | 0x7FC0u) : (uint16_t)(top + (low >> 15));
            lo[i] = low;
        }
    } else {
        uint16_t *hi = (uint16_t *)a->w + at;
        const uint32_t key = mix32(a->seed_lo ^ mix32(a->seed_hi ^ (uint32_t)((uint64_t)at >> 32)));
        const uint32_t first = (uint32_t)at;
        for (int i = 0; i < len; i++) {
            uint32_t noise = mix32(((first + (uint32_t)i) * 0x9E3779B1u) ^ key) & 0xFFFFu;
            uint32_t u = bits_of(p[i]);
            hi[i] = p[i] != p[i] ? 0x7FC0 : (uint16_t)((u + noise) >> 16);
        }
    }
}

/* Elements [start, stop) of one update; start a multiple of BLOCK. Returns 0. */
int tierstore_compressed_adamw(const update_args *a, int64_t start, int64_t stop) {
    for (int64_t at = start; at < stop; at += BLOCK) {
        int64_t len = stop - at < BLOCK ? stop - at : BLOCK;
        step_block(a, at, (int)len);
    }
    return 0;
}

/* The size of update_args, so the caller can check its own declaration against this one. */
int64_t tierstore_compressed_adamw_args_size(void) { return (int64_t)sizeof(update_args); }

/* The fields of update_args in declaration order, each with its byte offset: the caller checks its own
 * declaration field by field, by name and place. */
#define UPDATE_ARGS_FIELDS(X) X(n) X(moments) X(weight) X(grad) X(maximize) X(m) X(v) X(m_scales) X(v_scales) \
    X(map_m) X(map_v) X(table_m) X(table_v) X(w) X(low) X(seed_lo) X(seed_hi) X(g) X(decay) X(b1) X(omb1) X(b2) \
    X(omb2) X(bc2_sqrt) X(eps) X(step_size)
#define FIELD_OFFSET(f) (int64_t)offsetof(update_args, f),
#define FIELD_NAME(f) #f ","

/* The fields' names, each followed by a comma. */
const char *tierstore_compressed_adamw_args_names(void) { return UPDATE_ARGS_FIELDS(FIELD_NAME); }

/* Each field's byte offset into ``out`` (at most ``len``); returns how many fields there are. */
int64_t tierstore_compressed_adamw_args_offsets(int64_t *out, int64_t len) {
    static const int64_t at[] = {UPDATE_ARGS_FIELDS(FIELD_OFFSET)};
    int64_t count = (int64_t)(sizeof at / sizeof at[0]);
    for (int64_t i = 0; i < count && i < len; i++) out[i] = at[i];
    return count;
}

/* The gradient an update made before it is known to stand keeps, coded against the first moment the update read
 * (old) and made (new): see [Note: A kept gradient coded against its moments] in _grad_code.py. The moment's
 * update made new from old and the gradient, so old + (new - old) * inv, inv = 1 / (1 - beta1), lies within a few
 * units in the last place of the gradient where the moment is not much larger than it; each element is kept as the
 * difference of the two bit patterns where that fits a signed byte, -127 for +0.0, and -128 for "the next of the
 * escaped values", which follow the codes as raw bits in element order. Decoding computes the same prediction
 * from the same moments (one IEEE binary32 operation each, in the order written, without contraction) and adds. */
static inline uint32_t predicted(float old, float new_, float inv) { return bits_of(old + (new_ - old) * inv); }

/* Code n values of g into codes (n bytes) and escapes (4 bytes each, at most cap of them); returns how many
 * escaped, or -1 where more than cap would (the caller keeps the gradient as it is). */
int64_t tierstore_grad_code(int64_t n, const float *g, const float *old, const float *new_, float inv,
                            int8_t *codes, uint8_t *escapes, int64_t cap) {
    int64_t e = 0;
    for (int64_t at = 0; at < n; at += BLOCK) {
        int len = n - at < BLOCK ? (int)(n - at) : BLOCK;
        int8_t *c = codes + at;
        for (int i = 0; i < len; i++) {
            uint32_t gb = bits_of(g[at + i]);
            int32_t d = (int32_t)(gb - predicted(old[at + i], new_[at + i], inv));
            c[i] = gb == 0 ? (int8_t)-127 : (d >= -126 && d <= 127) ? (int8_t)d : (int8_t)-128;
        }
        for (int i = 0; i < len; i++) {
            if (c[i] != -128) continue;
            if (e == cap) return -1;
            memcpy(escapes + 4 * e, g + at + i, 4);
            e++;
        }
    }
    return e;
}

/* The n values tierstore_grad_code coded, into g. */
void tierstore_grad_decode(int64_t n, const int8_t *codes, const uint8_t *escapes, const float *old,
                           const float *new_, float inv, float *g) {
    int64_t e = 0;
    for (int64_t i = 0; i < n; i++) {
        int8_t c = codes[i];
        uint32_t bits;
        if (c == -127) {
            bits = 0;
        } else if (c == -128) {
            memcpy(&bits, escapes + 4 * e, 4);
            e++;
        } else {
            bits = predicted(old[i], new_[i], inv) + (uint32_t)(int32_t)c;
        }
        memcpy(g + i, &bits, 4);
    }
}
