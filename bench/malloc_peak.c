/* Heap bytes in use, and their peak, for one process: LD_PRELOAD this library (bench/pipeline_breakdown.py builds
 * it). Every malloc-family call is forwarded to glibc's own (__libc_*) and counted by malloc_usable_size, so the
 * counts are the bytes the engine (its arena's chunks, or, with the arena off, each tensor), numpy and Python's large
 * objects hold: a measure of buffers, not of pages (RSS). Read with ctypes: mp_current(), mp_peak(), mp_reset_peak().
 */
#include <stddef.h>
#include <errno.h>
#include <malloc.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);

static long long current, peak;

static void add(void *p) {
    if (!p) return;
    long long now = __atomic_add_fetch(&current, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
    long long seen = __atomic_load_n(&peak, __ATOMIC_RELAXED);
    while (now > seen && !__atomic_compare_exchange_n(&peak, &seen, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static void sub(void *p) {
    if (p) __atomic_sub_fetch(&current, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

void *malloc(size_t n) { void *p = __libc_malloc(n); add(p); return p; }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); add(p); return p; }
void free(void *p) { sub(p); __libc_free(p); }
void *realloc(void *old, size_t n) {
    sub(old);
    void *p = __libc_realloc(old, n);
    if (p) add(p); else if (old && n) add(old);  /* failed: the old block is still there */
    return p;
}
void *memalign(size_t align, size_t n) { void *p = __libc_memalign(align, n); add(p); return p; }
void *aligned_alloc(size_t align, size_t n) { return memalign(align, n); }
int posix_memalign(void **out, size_t align, size_t n) {
    void *p = __libc_memalign(align, n);
    if (!p) return ENOMEM;
    add(p);
    *out = p;
    return 0;
}
void *valloc(size_t n) { return memalign(4096, n); }

long long mp_current(void) { return __atomic_load_n(&current, __ATOMIC_RELAXED); }
long long mp_peak(void) { return __atomic_load_n(&peak, __ATOMIC_RELAXED); }
void mp_reset_peak(void) { __atomic_store_n(&peak, __atomic_load_n(&current, __ATOMIC_RELAXED), __ATOMIC_RELAXED); }
