/* How fast a native staging loop moves a file from a warm page cache to the GPU, with no
 * Python between the chunks: the ceiling the daemon's loader (backends/cuda_writer.py,
 * one preadv and a few driver calls from Python per chunk) is measured against.
 *
 * Each of T threads takes the next chunk of the file, waits for the copy out of the slot
 * of its ring of D pinned buffers that the chunk goes to, fills the slot (preadv, or
 * memcpy from a shared mapping of the file: InstantTensor's MMAP way), and copies it to
 * device memory on the thread's stream. Every (way, chunk, threads, depth) given is run
 * --reps times; one JSON line per run. Only the driver API, resolved with dlopen: no CUDA
 * headers or toolkit needed.
 *
 *   cc -O2 -pthread -o /tmp/staging_probe benchmarks/native/staging_probe.c -ldl
 *   /tmp/staging_probe FILE WAYS CHUNKS_MIB THREADS DEPTHS REPS   # e.g. F pread,mmap 1,2,4,16 12 1,3 3
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUevent;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cuEventCreate)(CUevent *, unsigned);
static CUresult (*cuEventRecord)(CUevent, CUstream);
static CUresult (*cuEventSynchronize)(CUevent);
static CUresult (*cuStreamSynchronize)(CUstream);

#define CK(x) do { CUresult r_ = (x); if (r_) { fprintf(stderr, "%s: %d\n", #x, r_); exit(1); } } while (0)

static void *sym(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (!p) { fprintf(stderr, "no %s in libcuda\n", name); exit(1); }
    return p;
}

static CUcontext ctx;
static CUdeviceptr dev;
static const char *base;  /* the shared mapping (mmap way) */
static int fd;
static size_t size, chunk;
static int depth, use_mmap;
static atomic_size_t next_chunk;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct { void **buf; CUevent *ev; int *busy; CUstream stream; } Ring;

static void *worker(void *arg) {
    Ring *r = arg;
    CK(cuCtxSetCurrent(ctx));
    for (size_t k = 0;; k++) {
        size_t i = atomic_fetch_add(&next_chunk, 1), off = i * chunk;
        if (off >= size) break;
        size_t n = size - off < chunk ? size - off : chunk;
        int s = (int)(k % depth);
        if (r->busy[s]) CK(cuEventSynchronize(r->ev[s]));
        if (use_mmap) {
            memcpy(r->buf[s], base + off, n);
        } else {
            for (size_t got = 0; got < n;) {
                ssize_t m = pread(fd, (char *)r->buf[s] + got, n - got, off + got);
                if (m <= 0) { perror("pread"); exit(1); }
                got += m;
            }
        }
        CK(cuMemcpyHtoDAsync(dev + off, r->buf[s], n, r->stream));
        CK(cuEventRecord(r->ev[s], r->stream));
        r->busy[s] = 1;
    }
    CK(cuStreamSynchronize(r->stream));
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: %s FILE WAYS CHUNKS_MIB THREADS DEPTHS REPS\n", argv[0]); return 2; }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    cuInit = sym(lib, "cuInit"); cuDeviceGet = sym(lib, "cuDeviceGet");
    cuDevicePrimaryCtxRetain = sym(lib, "cuDevicePrimaryCtxRetain"); cuCtxSetCurrent = sym(lib, "cuCtxSetCurrent");
    cuMemAlloc = sym(lib, "cuMemAlloc_v2"); cuMemHostAlloc = sym(lib, "cuMemHostAlloc");
    cuStreamCreate = sym(lib, "cuStreamCreate"); cuMemcpyHtoDAsync = sym(lib, "cuMemcpyHtoDAsync_v2");
    cuEventCreate = sym(lib, "cuEventCreate"); cuEventRecord = sym(lib, "cuEventRecord");
    cuEventSynchronize = sym(lib, "cuEventSynchronize"); cuStreamSynchronize = sym(lib, "cuStreamSynchronize");
    int d;
    CK(cuInit(0)); CK(cuDeviceGet(&d, 0)); CK(cuDevicePrimaryCtxRetain(&ctx, d)); CK(cuCtxSetCurrent(ctx));
    fd = open(argv[1], O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) { perror(argv[1]); return 1; }
    size = st.st_size;
    base = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) { perror("mmap"); return 1; }
    CK(cuMemAlloc(&dev, size));
    int reps = atoi(argv[6]);
    char ways[64], chunks[256], threads_s[64], depths[64];
    snprintf(ways, sizeof ways, "%s", argv[2]);
    char *save_w;
    for (char *w = strtok_r(ways, ",", &save_w); w; w = strtok_r(NULL, ",", &save_w)) {
        use_mmap = !strcmp(w, "mmap");
        snprintf(chunks, sizeof chunks, "%s", argv[3]);
        char *save_c;
        for (char *c = strtok_r(chunks, ",", &save_c); c; c = strtok_r(NULL, ",", &save_c)) {
            chunk = (size_t)atoi(c) << 20;
            snprintf(threads_s, sizeof threads_s, "%s", argv[4]);
            char *save_t;
            for (char *t = strtok_r(threads_s, ",", &save_t); t; t = strtok_r(NULL, ",", &save_t)) {
                int nt = atoi(t);
                snprintf(depths, sizeof depths, "%s", argv[5]);
                char *save_d;
                for (char *dd = strtok_r(depths, ",", &save_d); dd; dd = strtok_r(NULL, ",", &save_d)) {
                    depth = atoi(dd);
                    Ring *rings = calloc(nt, sizeof(Ring));
                    for (int i = 0; i < nt; i++) {
                        rings[i].buf = calloc(depth, sizeof(void *));
                        rings[i].ev = calloc(depth, sizeof(CUevent));
                        rings[i].busy = calloc(depth, sizeof(int));
                        CK(cuStreamCreate(&rings[i].stream, 1));
                        for (int s = 0; s < depth; s++) {
                            CK(cuMemHostAlloc(&rings[i].buf[s], chunk, 0));
                            memset(rings[i].buf[s], 0, chunk);
                            CK(cuEventCreate(&rings[i].ev[s], 2 /* CU_EVENT_DISABLE_TIMING */));
                        }
                    }
                    for (int rep = 0; rep < reps; rep++) {
                        for (int i = 0; i < nt; i++) memset(rings[i].busy, 0, depth * sizeof(int));
                        atomic_store(&next_chunk, 0);
                        pthread_t *th = calloc(nt, sizeof(pthread_t));
                        double t0 = now();
                        for (int i = 0; i < nt; i++) pthread_create(&th[i], NULL, worker, &rings[i]);
                        for (int i = 0; i < nt; i++) pthread_join(th[i], NULL);
                        double dt = now() - t0;
                        printf("{\"way\": \"%s\", \"chunk_mib\": %s, \"threads\": %d, \"depth\": %d, \"GBps\": %.2f}\n",
                               w, c, nt, depth, size / dt / 1e9);
                        fflush(stdout);
                        free(th);
                    }
                    /* the pinned buffers and streams stay: the probe's life is short */
                    free(rings);
                }
            }
        }
    }
    return 0;
}
